"""A worker's part in recovery: checkpoints it asks for, roll-backs, partial recovery, preemption, lineage."""
