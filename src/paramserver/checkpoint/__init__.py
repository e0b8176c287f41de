"""Checkpoints: one safetensors file per shard plus a JSON manifest written last (see docs/checkpoints.md)."""

from __future__ import annotations

from typing import Any


def save_shard(directory: str, name: str, shard: Any, tables: Any) -> dict[str, Any]:
    """Write one shard's file of checkpoint `name` under `directory` (a path or fsspec URL); the
    shard's Checkpoint method calls this (given to ShardService by whoever builds the node)."""
    import dataclasses

    from . import shard_file  # here: a PS that never checkpoints never loads safetensors or fsspec
    from .store import CheckpointStore

    return dataclasses.asdict(shard_file.write(CheckpointStore(directory), name, shard, tables))
