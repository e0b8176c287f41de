"""Export files: a checkpoint's trained values as one safetensors file, and deltas between checkpoints."""
