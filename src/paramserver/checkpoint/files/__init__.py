"""The files of a checkpoint: the tensor file format, a shard's file and metadata, int8 quantization."""
