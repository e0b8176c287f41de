"""A checkpoint's contents regrouped for a cluster of any size (restore onto more or fewer PS).

Dense variables are reassembled whole from their parts (a part named ``var[lo:hi]`` holds rows
lo..hi of axis 0), so a new shard can take any row range of them; table rows are pooled and a
new shard takes the ids that hash to it (``mix64(id) % num_shards``). Read-only after
construction, so thread-safe.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import numpy as np

from ..base.hashing import shard_of
from . import shard_file
from .store import CheckpointError, CheckpointStore

log = logging.getLogger(__name__)
_SPLIT = re.compile(r"^(.*)\[(\d+):(\d+)\]$")


def part_rows(part: str) -> tuple[str, int | None, int | None]:
    """(variable, lo, hi) of a part name; lo and hi are None for a whole variable."""
    match = _SPLIT.match(part)
    return (match.group(1), int(match.group(2)), int(match.group(3))) if match else (part, None, None)


@dataclass
class DenseVariable:
    value: np.ndarray
    state: dict[str, np.ndarray]
    steps: int


@dataclass
class SavedTable:
    meta: dict
    ids: np.ndarray
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # values, each state, row_step/last_seen/seen


class RestoreSource:
    """Everything in one checkpoint, checked against its manifest (size and SHA-256 of every file)."""

    def __init__(self, store: CheckpointStore, name: str) -> None:
        self.name = name
        self.manifest = store.manifest(name)
        self.step = int(self.manifest.get("step", 0))
        self.groups: dict[str, dict] = {}  # group -> {"spec", "vars": {var: DenseVariable}}
        self.tables: dict[str, SavedTable] = {}
        self.positions: dict[int, int] = {}  # each worker's steps at the checkpoint
        pieces: dict[tuple[str, str], list] = {}
        for entry in store.shard_files(name, self.manifest):
            contents = shard_file.decode(store.read_shard(name, entry), f"checkpoint {name}: {entry.file}")
            self._collect(contents, pieces)
        for (group, var), parts in pieces.items():
            parts.sort(key=lambda p: p[0] or 0)  # row ranges in order (a whole variable has one part)
            state = {key: np.concatenate([p[2][key] for p in parts]) for key in parts[0][2]}
            self.groups[group]["vars"][var] = DenseVariable(
                np.concatenate([p[1] for p in parts]), state, max(p[3] for p in parts)
            )

    @classmethod
    def latest(cls, store: CheckpointStore) -> RestoreSource | None:
        """The newest checkpoint that reads back whole; a damaged one is skipped (and logged)."""
        for name in reversed(store.complete()):
            try:
                return cls(store, name)
            except CheckpointError as exc:
                log.warning("cannot resume from %s, trying the one before: %s", name, exc)
        return None

    def position(self, worker: int | None) -> int:
        """Steps `worker` had trained at this checkpoint (the checkpoint's step if not recorded)."""
        return self.positions.get(worker, self.step) if worker is not None else self.step

    def _collect(self, contents: shard_file.ShardContents, pieces: dict) -> None:
        tensors = contents.tensors
        for worker, position in contents.meta.get("positions", {}).items():
            self.positions[int(worker)] = max(self.positions.get(int(worker), 0), position)
        for group, info in contents.meta["groups"].items():
            self.groups.setdefault(group, {"spec": info["spec"], "vars": {}})
            for part, steps in info["steps"].items():
                var, lo, _ = part_rows(part)
                prefix = f"dense/{group}/{part}"
                state = {
                    key[len(prefix) + 1 :]: array for key, array in tensors.items() if key.startswith(prefix + "/")
                }
                pieces.setdefault((group, var), []).append((lo, tensors[prefix], state, steps))
        for table, info in contents.meta["tables"].items():
            prefix = f"table/{table}/"
            arrays = {key[len(prefix) :]: array for key, array in tensors.items() if key.startswith(prefix)}
            ids = arrays.pop("ids")
            saved = self.tables.get(table)
            if saved is None:
                self.tables[table] = SavedTable(info, ids, arrays)
            else:
                saved.ids = np.concatenate([saved.ids, ids])
                saved.arrays = {key: np.concatenate([saved.arrays[key], array]) for key, array in arrays.items()}
                saved.meta["steps"] = max(saved.meta["steps"], info["steps"])
                for key, count in info["counters"].items():
                    saved.meta["counters"][key] = saved.meta["counters"].get(key, 0) + count

    # ---- what a new shard asks for ----------------------------------------------------------
    def dense_part(self, group: str, spec: dict, part: str, shape: tuple[int, ...]) -> DenseVariable:
        """Values, optimizer state and step count of one part under the new placement."""
        saved = self.groups.get(group)
        if saved is None:
            raise CheckpointError(
                f"checkpoint {self.name} has no variable group {group!r} (a checkpoint of "
                f"another model? it holds {sorted(self.groups)})"
            )
        if saved["spec"] != spec:
            raise CheckpointError(
                f"checkpoint {self.name}: group {group!r} was trained with optimizer {saved['spec']}, not {spec}"
            )
        var, lo, hi = part_rows(part)
        found = saved["vars"].get(var)
        if found is None:
            raise CheckpointError(f"checkpoint {self.name}: group {group!r} has no variable {var!r}")
        rows = slice(lo, hi) if lo is not None else slice(None)
        value = found.value[rows]
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(
                f"checkpoint {self.name}: variable {part!r} has shape {tuple(value.shape)} there, not {tuple(shape)}"
            )
        return DenseVariable(value, {key: array[rows] for key, array in found.state.items()}, found.steps)

    def fill_table(self, table, shard: int, num_shards: int) -> bool:
        """Load the saved rows of `table` that belong to `shard` of `num_shards` into it (an empty
        table with the `load_rows`/`restore_meta` methods); False if the checkpoint has no such table."""
        saved = self.tables.get(table.name)
        if saved is None:
            return False
        if saved.meta["dim"] != table.dim or saved.meta["spec"] != table.spec:
            raise CheckpointError(
                f"checkpoint {self.name}: table {table.name!r} has dim {saved.meta['dim']} and "
                f"optimizer {saved.meta['spec']}, not dim {table.dim} and {table.spec}"
            )
        mine = shard_of(saved.ids, num_shards) == shard
        table.load_rows(saved.ids[mine], {key: array[mine] for key, array in saved.arrays.items()})
        table.restore_meta(saved.meta["counters"], saved.meta["steps"])
        return True
