"""Checkpoints: one safetensors file per shard plus a JSON manifest written last (see docs/checkpoints.md)."""
