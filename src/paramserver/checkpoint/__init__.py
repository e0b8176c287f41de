"""Checkpoints: one safetensors file per shard plus a JSON manifest written last (see docs/checkpoints.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paramserver.checkpoint.shard_writes import ShardWrites


def shard_writer(directory: str, encoding: str = "none", allow_non_finite: bool = False) -> ShardWrites | None:
    """The writer a ShardService is given: its Checkpoint calls, written under the node's own
    checkpoint directory (no path ever comes from the wire) with names in sequence only
    (checkpoint/shard_writes.py), table values stored in `encoding` (checkpoint/files/quantize.py),
    each file checked as it is written with restore's checks (NaN and infinite values pass when
    `allow_non_finite`: the PS's restore_non_finite), or None without one (Checkpoint is refused)."""
    if not directory:
        return None
    from paramserver.checkpoint.shard_writes import (
        ShardWrites,
    )  # here: a PS that never checkpoints never loads safetensors or fsspec

    return ShardWrites(directory, encoding, allow_non_finite)
