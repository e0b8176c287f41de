"""Checkpoints: one safetensors file per shard plus a JSON manifest written last (see docs/checkpoints.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def save_shard(directory: str, name: str, shard: Any) -> dict[str, Any]:
    """Write one shard's file of checkpoint `name` under `directory` (a path or fsspec URL).

    The name is checked (a checkpoint name, not a committed checkpoint) before any snapshot is
    taken: a refused request costs no copy of the shard and holds no lock."""
    import dataclasses

    from . import shard_file  # here: a PS that never checkpoints never loads safetensors or fsspec
    from .store import CheckpointStore

    store = CheckpointStore(directory)
    store.check_new(name)
    return dataclasses.asdict(shard_file.write(store, name, shard, shard.tables))


def shard_writer(directory: str) -> Callable[[str, Any], dict[str, Any]] | None:
    """The writer a ShardService is given: `save_shard` bound to the node's own checkpoint
    directory (no path ever comes from the wire), or None without one (Checkpoint is refused)."""
    return functools.partial(save_shard, directory) if directory else None
