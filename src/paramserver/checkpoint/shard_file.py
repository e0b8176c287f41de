"""A shard's state as one safetensors file, and back.

Tensor names: ``dense/<group>/<part>`` (values, shaped like the part), ``dense/<group>/<part>/<state>``
(each optimizer state), ``table/<table>/ids|values|<state>|row_step|last_seen|seen`` (one row per
stored id, in row order). The file's metadata key ``paramserver`` holds JSON: the shard index,
its version and sync step, each group's optimizer spec and per-part step counts, and each
table's dim, optimizer, initializer, row policy, counters and update count.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors import numpy as safetensors_numpy

from ..server.dense import DenseGroup
from ..server.embedding_table import EmbeddingTable
from ..server.shard import Shard
from ..server.table_store import TableStore
from .store import CheckpointError, CheckpointStore, ShardFile

_META_KEY = "paramserver"


@dataclass
class ShardContents:
    meta: dict[str, Any]
    tensors: dict[str, np.ndarray]


def encode(
    index: int,
    version: int,
    sync_step: int,
    groups: dict[str, DenseGroup],
    tables: dict[str, EmbeddingTable],
    positions: dict[int, int] | None = None,
) -> bytes:
    """The file's bytes; the caller holds the locks that keep groups and tables still."""
    tensors: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {
        "shard": index,
        "version": version,
        "sync_step": sync_step,
        "groups": {},
        "tables": {},
        "positions": {str(w): p for w, p in (positions or {}).items()},
    }
    for name, group in groups.items():
        meta["groups"][name] = {"spec": group.spec, "steps": dict(group.steps)}
        for part, slot in group.slots.items():
            tensors[f"dense/{name}/{part}"] = group.view(part)
            for key, array in group.state.items():
                tensors[f"dense/{name}/{part}/{key}"] = array[slot.start : slot.stop].reshape(slot.shape)
    for name, table in tables.items():
        n = table.size
        meta["tables"][name] = {
            "dim": table.dim,
            "spec": table.spec,
            "init": table.init,
            "policy": asdict(table.policy),
            "counters": dict(table.counters),
            "steps": table.steps,
        }
        for _, arrays in table.row_chunks(max(n, 1)):
            tensors.update({f"table/{name}/{key}": array for key, array in arrays.items()})
        if n == 0:
            tensors.update(
                {f"table/{name}/{key}": np.zeros((0, *shape), dtype) for key, (dtype, shape) in table.layout().items()}
            )
    contiguous = {key: np.ascontiguousarray(value) for key, value in tensors.items()}
    return safetensors_numpy.save(contiguous, metadata={_META_KEY: json.dumps(meta)})


def decode(data: bytes, where: str) -> ShardContents:
    """Parse a shard file; `where` names it in errors."""
    try:
        tensors = safetensors_numpy.load(data)
        header_size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_size])
        meta = json.loads(header["__metadata__"][_META_KEY])
    except (SafetensorError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{where}: not a paramserver shard file ({exc})") from None
    return ShardContents(meta, tensors)


def write(store: CheckpointStore, name: str, shard: Shard, tables: TableStore) -> ShardFile:
    """Write `shard`'s file of checkpoint `name`: a snapshot taken while nothing changes it."""
    data = shard.snapshot(
        lambda groups, version, sync_step: tables.snapshot(
            lambda saved_tables: encode(shard.index, version, sync_step, groups, saved_tables, shard.positions())
        )
    )
    return store.write_shard(name, shard.index, data)
