"""An embedding table on a shard: rows keyed by any int64 id, created on first touch.

Rows live in one contiguous (capacity x dim) float32 array, with one array of the same shape
per optimizer state (and one of row ids, and use counters when kept), found through a
vectorized HashIndex. A new row is initialized from a hash of (id, column), so its initial
value depends on the id alone: the same on any shard and in any order of arrival.

Growth never copies a large table, so no lookup waits on one (a copy of the arrays stalled the
shard for seconds at tens of millions of rows). Small tables keep ordinary arrays grown by
copying (1.5x, a few MB at most). Once the arrays pass `_RESERVE_FROM` bytes they move, with a
last copy, into address space reserved up front (tables/reserved.py: `_RESERVE_BYTES` per array,
costing memory only where written): from then on growing the capacity is taking a longer view
of the same memory. The logical capacity still grows 1.5x at a time, as limits.py accounts it.
Where the system refuses the reservation (strict overcommit, an RLIMIT_AS) the arrays keep
growing by copying. The index grows incrementally (hash_index.py).

Every array of a row is written when the row is created (`_start_rows`): unwritten reserved
memory reads as zeros, not as an optimizer's initial state, and the rows an eviction frees
(their pages handed back) may be taken again by new ids.

What changed since a checkpoint (for incremental ones, checkpoint/chain.py): every row carries
the epoch it last changed in (`changed`, 4 bytes; written wherever a row's saved arrays are:
creation, apply, a lookup that counts use, a load), and every id eviction dropped is logged with
its epoch while a later checkpoint may still need to name it (`deleted_since`). The owning store
moves the epoch on when a snapshot begins, so the rows a delta on snapshot `p` holds are those
stamped after `p`.

Not thread-safe: the owning TableStore serializes calls on a table (its lock); calls on different
tables run at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import numpy as np

from paramserver.base import kernels
from paramserver.base.errors import InvalidArgumentError
from paramserver.base.hashing import count_distinct, mix64
from paramserver.tables import reserved
from paramserver.tables.hash_index import HashIndex
from paramserver.tables.row_admission import Admission
from paramserver.tables.row_snapshot import RowSnapshot
from paramserver.tables.sparse_optimizers import SparseOptimizer

_GROWTH = 1.5  # capacity growth of the row arrays: bounds wasted memory at a third
# bytes of a table's row arrays from which they live in reserved address space (a test seam:
# tests set it small to reach that path with small tables)
_RESERVE_FROM = 8 << 20
_RESERVE_BYTES = 64 << 30  # address space reserved per row array (past it, one more copy into a larger one)


_KINDS = {"normal": 1, "uniform": 2}


def initial_rows(ids: np.ndarray, dim: int, init: dict) -> np.ndarray:
    """Deterministic initial rows: {"kind": "zeros"} | {"kind": "uniform", "scale": s} | {"kind": "normal", "std": s}.

    Each value comes from a 64-bit hash of (id, column): two 24-bit uniforms, turned into a
    normal by Box-Muller, in float32 (the C kernel computes the same, in one pass).
    """
    kind = init.get("kind", "normal")
    if kind == "zeros":
        return np.zeros((ids.shape[0], dim), np.float32)
    if kind not in _KINDS:
        raise InvalidArgumentError(f"unknown initializer {kind!r}; known: zeros, uniform, normal")
    scale = np.float32(init.get("std", 0.01) if kind == "normal" else init.get("scale", 0.05))
    ids = np.ascontiguousarray(ids, np.int64)
    out = np.empty((ids.shape[0], dim), np.float32)
    if kernels.KERNELS is not None:
        kernels.KERNELS.ps_random_rows(kernels.ptr(ids), ids.shape[0], dim, _KINDS[kind], scale, kernels.ptr(out))
        return out
    cols = np.arange(dim, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    bits = mix64((mix64(ids)[:, None] ^ cols).view(np.int64))
    u1 = ((bits >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(1 / (1 << 24))
    if kind == "uniform":
        np.multiply(u1 * np.float32(2) - np.float32(1), scale, out=out)
        return out
    u2 = ((bits & np.uint64(0xFFFFFF)).astype(np.float32) + np.float32(0.5)) * np.float32(1 / (1 << 24))
    np.log(u1, out=out)
    out *= np.float32(-2)
    np.sqrt(out, out=out)
    out *= np.cos(u2 * np.float32(2 * np.pi))
    out *= scale
    return out


@dataclass(frozen=True)
class RowPolicy:
    """Which ids get a row, and which rows are dropped again.

    admit_after: an id gets a row on its C-th lookup (1: at once); admit_probability: or with this
    chance per lookup. Until admitted, lookups return the id's initial values and its gradients
    are dropped. ttl_steps: a row not looked up for this many table updates is evicted;
    min_count: at eviction time, rows looked up fewer times are evicted too; max_rows: past this
    many rows the least recently seen are evicted; evict_every: updates between eviction passes.
    0 turns each rule off.
    """

    admit_after: int = 1
    admit_probability: float = 1.0
    ttl_steps: int = 0
    min_count: int = 0
    max_rows: int = 0
    evict_every: int = 0

    @classmethod
    def from_dict(cls, data: dict | None) -> RowPolicy:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data or {}) - known)
        if unknown:
            raise InvalidArgumentError(f"unknown row policy keys {unknown}; known: {sorted(known)}")
        policy = cls(**(data or {}))
        numbers = (policy.admit_after, policy.ttl_steps, policy.min_count, policy.max_rows, policy.evict_every)
        if (
            not all(type(n) is int for n in numbers)
            or type(policy.admit_probability) not in (int, float)
            or policy.admit_after < 1
            or not 0 < policy.admit_probability <= 1
            or min(numbers[1:]) < 0
        ):
            raise InvalidArgumentError(f"invalid row policy {str(data)[:200]}")
        return policy


class EmbeddingTable:
    """Rows of `dim` float32 values keyed by int64 ids, with a row-wise optimizer."""

    def __init__(
        self,
        name: str,
        dim: int,
        optimizer: SparseOptimizer,
        init: dict,
        spec: dict,
        capacity: int = 1024,
        policy: RowPolicy | None = None,
    ) -> None:
        if not isinstance(dim, int) or dim < 1:
            raise InvalidArgumentError(f"table {name!r}: dim must be a positive integer, got {dim!r}")
        initial_rows(np.zeros(1, np.int64), dim, init)  # refuse a bad initializer now
        self.name, self.dim, self.optimizer, self.init, self.spec = name, dim, optimizer, init, spec
        self.index = HashIndex(2 * capacity)
        self.policy = policy or RowPolicy()
        # per-row use, kept only when an eviction rule needs it (16 bytes a row)
        self.tracks_use = bool(self.policy.ttl_steps or self.policy.min_count or self.policy.max_rows)
        self._shapes = self._row_shapes()
        self._row_nbytes = sum(dtype.itemsize * int(np.prod(shape)) for shape, dtype in self._shapes.values())
        # each row array at its allocated length, by layout() name; the attributes below are views
        # of their first `capacity` rows
        self._full: dict[str, np.ndarray] = {}
        self._capacity, self._reserved = 0, False
        self.values = np.zeros((0, dim), np.float32)
        self.row_ids = np.zeros(0, np.int64)  # the id of each row: a checkpoint streams rows in order
        self.last_seen = np.zeros(0, np.int64)  # table update count when each row was last looked up
        self.seen = np.zeros(0, np.int64)  # lookups of each row
        self.state: dict[str, np.ndarray] = {}
        self._allocate(capacity)
        self.admission = Admission(self.policy)
        self.counters = {"admitted": 0, "not_admitted_lookups": 0, "dropped_gradients": 0, "evicted": 0}
        self.steps = 0
        self.snapshot: RowSnapshot | None = None  # a checkpoint's view of the rows, while one is written
        self.epoch = 1  # stamped on changed rows; the store moves it on at each snapshot
        self._deleted: list[tuple[int, np.ndarray]] = []  # (epoch, ids) evicted, while a delta may name them

    def _row_shapes(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Each row array (by layout() name): the shape of one row, and its dtype."""
        f32, i64 = np.dtype(np.float32), np.dtype(np.int64)
        shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {"ids": ((), i64), "values": ((self.dim,), f32)}
        shapes.update({key: ((self.dim,), f32) for key in self.optimizer.state_init()})
        if self.optimizer.hyper.get("per_row_step"):
            shapes["row_step"] = ((), i64)
        if self.tracks_use:
            shapes.update(last_seen=((), i64), seen=((), i64))
        shapes["changed"] = ((), np.dtype(np.uint32))  # not saved: the epoch each row last changed in
        return shapes

    @property
    def size(self) -> int:
        return self.index.size

    @property
    def in_reserved_space(self) -> bool:
        """Whether the row arrays live in reserved address space (they grow in place), not in
        ordinary arrays (they grow by copying)."""
        return self._reserved

    @property
    def capacity(self) -> int:
        """Rows the arrays have room for now: it grows 1.5x at a time (what limits.py accounts),
        in place once the arrays live in reserved address space."""
        return self._capacity

    def rows(self, ids: np.ndarray, create: bool = True) -> np.ndarray:
        """Row numbers of `ids`; missing ids are admitted by the policy (-1 where not)."""
        return self._rows(ids, create)[0]

    def _rows(self, ids: np.ndarray, create: bool = True) -> tuple[np.ndarray, bool]:
        """`rows`, and whether every id has one (no mask to build on the common path)."""
        rows, absent = self.index.find_counted(ids)
        if not absent:
            return rows, True
        missing = np.flatnonzero(rows < 0)
        if create and missing.size:
            # sorted: new rows take ids in order, as a tiered table's do (eviction ties go by row)
            candidates, where = np.unique(ids[missing], return_inverse=True)  # a batch may name a new id twice
            admit = self.admission.admit(candidates)
            new_ids = candidates[admit]
            self._make_room(self.size + new_ids.shape[0])
            lo = self.size
            new_rows = np.full(candidates.shape[0], -1, np.int64)
            new_rows[admit] = self.index.insert(new_ids)
            self._start_rows(lo, new_ids)
            self.values[lo : self.size] = initial_rows(new_ids, self.dim, self.init)
            rows[missing] = new_rows[where.reshape(-1)]
            self.counters["admitted"] += new_ids.shape[0]
            self.counters["not_admitted_lookups"] += int((~admit).sum())
            return rows, bool(admit.all())
        return rows, False

    def layout(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """What a saved row holds: array name -> (dtype, shape of one row), in file order:
        "ids", "values", each optimizer state (and "row_step"), "last_seen" and "seen" when kept."""
        arrays: dict[str, np.ndarray] = {"ids": self.row_ids, "values": self.values, **self.state}
        if self.tracks_use:
            arrays.update(last_seen=self.last_seen, seen=self.seen)
        return {name: (array.dtype, array.shape[1:]) for name, array in arrays.items()}

    def row_chunks(self, chunk_rows: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """(first row, {array name: rows}) for consecutive chunks of at most `chunk_rows` rows,
        every array of `layout()` in each: views, no copy. The caller keeps the table still
        (holds the store's lock) until it is done with them."""
        names = self.layout()
        for lo in range(0, self.size, chunk_rows):
            hi = min(lo + chunk_rows, self.size)
            yield lo, {name: self.array(name)[lo:hi] for name in names}

    def begin_snapshot(self, slice_rows: int, budget_bytes: int, since: int | None = None) -> RowSnapshot:
        """Start a checkpoint's view of the rows as they are now (see RowSnapshot); until
        `end_snapshot`, changed rows are kept aside for it and eviction waits. `since`: only the
        rows changed after snapshot epoch `since` (a delta), with the ids evicted since then."""
        deleted = self.deleted_since(since) if since is not None else None
        self.snapshot = RowSnapshot(
            self.size, self.layout(), self.array, slice_rows, budget_bytes, since=since, deleted=deleted
        )
        return self.snapshot

    def deleted_since(self, epoch: int) -> np.ndarray:
        """The ids evicted after snapshot epoch `epoch` (distinct, sorted)."""
        parts = [ids for at, ids in self._deleted if at > epoch]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

    def forget_deleted(self, epoch: int) -> None:
        """Drop the evicted ids logged up to epoch `epoch`: no delta will be written on an earlier snapshot."""
        self._deleted = [(at, ids) for at, ids in self._deleted if at > epoch]

    def delete_ids(self, ids: np.ndarray) -> int:
        """Remove the rows of `ids` that are stored (a delta's evictions, on restore); returns how many.
        The rows kept stay in order (as eviction keeps them)."""
        rows = self.index.find(np.ascontiguousarray(ids, np.int64))
        rows = rows[rows >= 0]
        if rows.size:
            keep = np.ones(self.size, bool)
            keep[rows] = False
            self._compact(keep)
        return int(rows.size)

    def end_snapshot(self) -> None:
        self.snapshot = None

    def array(self, name: str) -> np.ndarray:
        """The live array of one `layout()` name, at its allocated length (growth may replace it)."""
        return self._full[name]

    def load_rows(self, ids: np.ndarray, arrays: dict[str, np.ndarray], overwrite: bool = False) -> None:
        """Add saved rows (a restore, one chunk at a time): `arrays` holds "values", each optimizer
        state, and optionally "row_step", "last_seen", "seen", one row per id. The ids must be
        distinct, and not stored yet unless `overwrite` (a delta's rows: stored ones are written in
        place, new ones added at the end); InvalidArgumentError otherwise (a file is not trusted)."""
        ids = np.ascontiguousarray(ids, np.int64)
        if count_distinct(ids) != ids.shape[0]:
            raise InvalidArgumentError(f"table {self.name!r}: saved rows name an id twice")
        found = self.index.find(ids)
        stored = found >= 0
        if stored.any() and not overwrite:
            raise InvalidArgumentError(f"table {self.name!r}: saved rows name an id twice")
        names = sorted(self._shapes.keys() & arrays.keys() - {"ids", "changed"})
        if stored.any():
            for name in names:
                self._full[name][found[stored]] = arrays[name][stored]
            self.changed[found[stored]] = self.epoch
        new = ~stored
        self._make_room(self.size + int(new.sum()))
        lo = self.size
        self.index.insert(ids[new])
        self._start_rows(lo, ids[new])
        for name in names:
            self._full[name][lo : self.size] = arrays[name] if new.all() else arrays[name][new]

    def restore_meta(self, counters: dict[str, int], steps: int) -> None:
        """Set the counters and update count a checkpoint saved (after its rows are loaded)."""
        self.counters.update({key: int(counters.get(key, 0)) for key in self.counters})
        self.steps = int(steps)

    def read(self, ids: np.ndarray) -> np.ndarray:
        """The rows of `ids` (distinct), admitted on first touch by default; a copy, len(ids) x dim.

        An id not admitted yet reads as its initial values.
        """
        rows, every = self._rows(ids)  # first: it may grow (replace) the arrays
        if every and not self.tracks_use:
            return gather_rows(self.values, rows)
        stored = rows >= 0
        if self.tracks_use:
            if self.snapshot is not None:
                self.snapshot.preserve(rows[stored])
            self.last_seen[rows[stored]] = self.steps
            self.seen[rows[stored]] += 1
            self.changed[rows[stored]] = self.epoch
        if stored.all():
            return gather_rows(self.values, rows)
        out = initial_rows(ids, self.dim, self.init)
        out[stored] = gather_rows(self.values, rows[stored])
        return out

    def apply(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """One optimizer step on the rows of `ids` (distinct) from `grads` (len(ids) x dim).

        Gradients of ids without a row (not admitted, or evicted) are dropped and counted.
        """
        rows, absent = self.index.find_counted(ids)
        self.counters["dropped_gradients"] += absent
        self.steps += 1
        stored = rows >= 0 if absent else None  # none built where every id has a row (the common case)
        if self.snapshot is not None:
            self.snapshot.preserve(rows if stored is None else rows[stored])
        if stored is None:
            self.optimizer.update(self.values, rows, grads, self.state, self.steps)
        elif absent < ids.shape[0]:
            self.optimizer.update(self.values, rows[stored], grads[stored], self.state, self.steps)
        stamp_rows(self.changed, rows, self.epoch)
        if self.policy.evict_every and self.steps % self.policy.evict_every == 0:
            self.evict()

    def evict(self) -> int:
        """Drop rows by the policy (ttl, min_count, max_rows); returns how many. Compacts the arrays."""
        if self.snapshot is not None:  # eviction moves rows: it waits for the checkpoint's writer
            return 0
        policy, n = self.policy, self.size
        keep = np.ones(n, bool)
        if policy.ttl_steps:
            keep &= self.steps - self.last_seen[:n] <= policy.ttl_steps
        if policy.min_count:
            keep &= self.seen[:n] >= policy.min_count
        if policy.max_rows and keep.sum() > policy.max_rows:
            order = np.argsort(-self.last_seen[:n] * keep, kind="stable")  # most recently seen first
            keep[:] = False
            keep[order[: policy.max_rows]] = True
        evicted = int(n - keep.sum())
        if evicted:
            if self.epoch > 1:  # a snapshot was taken: a delta on it names what is gone since
                self._deleted.append((self.epoch, self.row_ids[:n][~keep].copy()))
            self._compact(keep)
            self.counters["evicted"] += evicted
        return evicted

    def _compact(self, keep: np.ndarray) -> None:
        """Move the kept rows to the front (in order) and index them anew; the freed rows' pages
        go back to the kernel where the arrays are reserved (new rows write every array anyway)."""
        size = self.size
        kept_rows = np.flatnonzero(keep[:size])
        kept = kept_rows.shape[0]
        for array in self._full.values():
            array[:kept] = array[kept_rows]
            if self._reserved:
                reserved.release(array, kept, size)
        self.index = HashIndex.holding(kept)
        self.index.insert(self.row_ids[:kept])

    def describe(self) -> dict:
        # reserved arrays hold memory for the rows written: [0, size), as evictions hand pages back
        rows = self.size if self._reserved else self._capacity
        return {
            "rows": self.size,
            "dim": self.dim,
            "updates": self.steps,
            **self.counters,
            "bytes": rows * self._row_nbytes + self.index.nbytes,
        }

    def _start_rows(self, lo: int, ids: np.ndarray) -> None:
        """Write every array of the new rows [lo, lo + len(ids)) but their values: their memory may hold
        an evicted row's, or (reserved) zeros rather than the optimizer's initial state."""
        hi = lo + ids.shape[0]
        self.row_ids[lo:hi] = ids
        self.changed[lo:hi] = self.epoch
        fill = self.optimizer.state_init()
        for key, array in self.state.items():
            array[lo:hi] = fill.get(key, 0)
        if self.tracks_use:
            self.last_seen[lo:hi] = 0
            self.seen[lo:hi] = 0

    def _make_room(self, needed: int) -> None:
        """Capacity for `needed` rows, grown 1.5x at a time: in place within the reserved address
        space, else into new arrays (a copy of the rows held)."""
        if needed <= self._capacity:
            return
        capacity = max(needed, int(self._capacity * _GROWTH))
        room = self._full["ids"].shape[0]
        if needed <= room:
            self._bind(min(capacity, room))
        else:
            self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        """New arrays for `capacity` rows, the rows held copied in: reserved ones once they pass
        `_RESERVE_FROM` bytes (where the system allows it), else ordinary ones."""
        full = self._reserve_arrays(capacity) if capacity * self._row_nbytes >= _RESERVE_FROM else None
        self._reserved = full is not None
        if full is None:
            full = {name: np.zeros((capacity, *shape), dtype) for name, (shape, dtype) in self._shapes.items()}
        size = self.size
        for name, array in self._full.items():
            full[name][:size] = array[:size]
        self._full = full
        self._bind(capacity)

    def _reserve_arrays(self, capacity: int) -> dict[str, np.ndarray] | None:
        """Row arrays in reserved address space, room for as many rows as `_RESERVE_BYTES` holds of
        the widest array (or twice `capacity`, past that); None where the system refuses one."""
        widest = max(dtype.itemsize * int(np.prod(shape)) for shape, dtype in self._shapes.values())
        rows = max(2 * capacity, _RESERVE_BYTES // widest)
        arrays = {}
        for name, (shape, dtype) in self._shapes.items():
            array = reserved.reserve(rows, shape, dtype, huge=True)
            if array is None:
                return None
            arrays[name] = array
        return arrays

    def _bind(self, capacity: int) -> None:
        """Point the row attributes at the first `capacity` rows of the arrays."""
        self._capacity = capacity
        views = {name: array[:capacity] for name, array in self._full.items()}
        self.row_ids, self.values = views.pop("ids"), views.pop("values")
        if self.tracks_use:
            self.last_seen, self.seen = views.pop("last_seen"), views.pop("seen")
        self.changed = views.pop("changed")
        self.state.update(views)


def stamp_rows(changed: np.ndarray, rows: np.ndarray, epoch: int) -> None:
    """changed[rows] = epoch for the rows >= 0 (one C pass; numpy masks first)."""
    if kernels.KERNELS is None or not rows.flags.c_contiguous or rows.dtype != np.int64:
        changed[rows[rows >= 0]] = epoch
        return
    kernels.KERNELS.ps_stamp_rows(kernels.ptr(changed), kernels.ptr(rows), rows.shape[0], epoch)


def gather_rows(values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """values[rows] (a copy) for row numbers >= 0; the C loop fetches rows ahead of use."""
    if kernels.KERNELS is None or not values.flags.c_contiguous or values.dtype != np.float32:
        return values[rows]
    rows = np.ascontiguousarray(rows, np.int64)
    out = np.empty((rows.shape[0], values.shape[1]), values.dtype)
    kernels.KERNELS.ps_gather_rows(
        kernels.ptr(values), kernels.ptr(rows), rows.shape[0], values.shape[1], kernels.ptr(out)
    )
    return out
