"""The worker's side of embedding tables: ids routed to shards by hash, rows gathered back.

Every shard holds a part of every table; an id lives on shard `mix64(id) % num_shards`, so
the same id always meets the same row. Thread-safety as PSClient: one training thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..base.compression_spec import NONE, Codec
from ..base.errors import InvalidArgumentError
from ..base.hashing import shard_of
from ..transport.channel import ShardChannel
from ..wire import codec
from ..wire import messages as msg
from .compression import GradientCompressor


class RowsHandle:
    """The rows of a lookup in flight. `wait()` gathers them, within the lookup's deadline."""

    def __init__(self, calls: list, count: int, deadline: float) -> None:
        self._calls, self._count, self._deadline = calls, count, deadline

    def wait(self) -> np.ndarray:
        return _joined(
            self._count,
            (
                (where, codec.decode(call.wait(max(0.0, self._deadline - time.monotonic()))).tensors["rows"])
                for where, call in self._calls
            ),
        )


def _joined(count: int, pieces) -> np.ndarray:
    """(count x dim) rows put together from each shard's (positions, rows), in their wire dtype."""
    rows = None
    for where, got in pieces:
        if rows is None:
            rows = np.empty((count, got.shape[1]), got.dtype)
        rows[where] = got
    return rows if rows is not None else np.empty((0, 0), np.float32)


class StepRiders:
    """Row pushes and lookups that ride along a step's PushPull, so that one request per shard
    carries the dense gradients, the row gradients and the next batch's lookups together.

    Per shard, the PushPullRequest's `sparse` (RowPush: table, ids name, grads name) and `lookup`
    (RowLookup: table, ids name, rows name); rider tensors are named with a leading "~" (never a
    variable's name).
    The shard applies the row pushes with the dense push and reads the lookups after both, so
    the rows include this step's update. Row gradients are encoded by their table's codec (`codecs`:
    the encodings by shard, for the request). Built by TableClient.riders(); not thread-safe.
    """

    def __init__(
        self,
        split: Callable[[np.ndarray], list],
        num_shards: int,
        table_codecs: dict[str, Codec] | None = None,
        compressor: GradientCompressor | None = None,
    ) -> None:
        self._split = split
        self._num_shards = num_shards
        self._table_codecs = table_codecs or {}
        self._compressor = compressor or GradientCompressor()
        self.codecs: dict[int, dict[str, dict]] = {}  # by shard: {grads name: encoding}
        self.row_pushes: dict[int, list[msg.RowPush]] = {}  # by shard
        self.lookups: dict[int, list[msg.RowLookup]] = {}  # by shard
        self.tensors: dict[int, list[tuple[str, np.ndarray]]] = {}
        self._lookups: list[tuple[int, list[tuple[int, np.ndarray, str]]]] = []  # (count, [(shard, where, rows name)])

    def push(self, table: str, ids: np.ndarray, grads: np.ndarray) -> None:
        """Add a row push. Every shard gets one, empty where it holds none of `ids`: each shard
        counts the table's steps, and torch counts a step whenever the table has a gradient."""
        parts = {shard: (where, part) for shard, where, part in self._split(ids)}
        for shard in range(self._num_shards):
            where, part = parts.get(shard, (slice(0, 0), ids[:0]))
            name = self._name(shard, "s")
            self.row_pushes.setdefault(shard, []).append(msg.RowPush(table, name + ".ids", name + ".grads"))
            header, encoded = self._compressor.encode_rows(
                self._table_codecs.get(table, NONE), name + ".grads", grads[where]
            )
            self.tensors.setdefault(shard, []).extend([(name + ".ids", part), *encoded])
            if header is not None:
                self.codecs.setdefault(shard, {})[name + ".grads"] = header

    def lookup(self, table: str, ids: np.ndarray) -> int:
        """Add a lookup of distinct `ids`; returns its index in `rows()`."""
        placed = []
        for shard, where, part in self._split(ids):
            name = self._name(shard, "l")
            self.lookups.setdefault(shard, []).append(msg.RowLookup(table, name + ".ids", name + ".rows"))
            self.tensors.setdefault(shard, []).append((name + ".ids", part))
            placed.append((shard, where, name + ".rows"))
        self._lookups.append((ids.shape[0], placed))
        return len(self._lookups) - 1

    def rows(self, replies: dict[int, dict[str, np.ndarray]]) -> list[np.ndarray]:
        """The rows of each lookup (copies), from each shard's reply tensors."""
        return [
            _joined(count, ((where, replies[shard][name]) for shard, where, name in placed))
            for count, placed in self._lookups
        ]

    def _name(self, shard: int, kind: str) -> str:
        return f"~{kind}{len(self.tensors.get(shard, ()))}"


class TableClient:
    """Registers tables, looks rows up, pushes row gradients."""

    def __init__(
        self,
        channels: list[ShardChannel],
        rpc_timeout_s: float,
        consistency: dict | None = None,
        worker: int | None = None,
        compressor: GradientCompressor | None = None,
    ) -> None:
        self.channels = channels
        self.compressor = compressor or GradientCompressor()  # a PSClient's: one count of gradient bytes
        self.codecs: dict[str, Codec] = {}  # by table: how row gradients riding along a step are encoded
        self.rpc_timeout_s = rpc_timeout_s
        self.consistency = consistency  # the mode, told to shards that hold no dense variable
        self.worker = worker  # named when registering: a PS node accepts pushes only from workers that registered

    def register(
        self,
        table: str,
        dim: int,
        optimizer_spec: dict,
        init: dict,
        policy: dict | None = None,
        capacity: int = 0,
        wire: str = "float32",
        compression: Codec = NONE,
    ) -> None:
        """Create the table on every shard; `capacity` (rows, all shards together) is reserved up front.
        `wire`: how its rows and row gradients travel (float32, bfloat16 or float16; wire/half.py).
        `compression`: how a float32 table's row gradients ride along steps (fp16, bf16 or int8; StepRiders)."""
        if compression.kind == "topk":
            raise InvalidArgumentError(
                f"table {table!r}: topk compresses dense gradients only; a table's row "
                f"gradients take fp16, bf16 or int8"
            )
        per_shard = -(-capacity // len(self.channels))  # ids spread evenly over shards by hash
        request = msg.RegisterTableRequest(
            table=table,
            dim=dim,
            optimizer=optimizer_spec,
            init=init,
            policy=policy or {},
            capacity=per_shard,
            num_shards=len(self.channels),
            consistency=self.consistency,
            worker=self.worker,
            dtype=wire,
        )
        payload = codec.encode(request.to_meta())
        self.wait_all([channel.call("RegisterTable", payload, self.rpc_timeout_s) for channel in self.channels])
        self.codecs[table] = compression

    def lookup(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Rows (len(ids) x dim) of distinct int64 `ids`, in their order; missing rows are created."""
        return self.start_lookup(table, ids).wait()

    def start_lookup(self, table: str, ids: np.ndarray) -> RowsHandle:
        """Send a lookup and return at once; `wait()` on the handle gives the rows."""
        meta = msg.LookupRequest(table=table).to_meta()
        calls = [
            (where, self.channels[shard].call("Lookup", codec.encode_parts(meta, [("ids", part)]), self.rpc_timeout_s))
            for shard, where, part in self._split(ids)
        ]
        return RowsHandle(calls, ids.shape[0], time.monotonic() + self.rpc_timeout_s)

    def push(self, table: str, ids: np.ndarray, grads: np.ndarray) -> list:
        """Send one row-wise update; returns the calls in flight (wait with `wait_all`)."""
        meta = msg.PushSparseRequest(table=table).to_meta()
        return [
            self.channels[shard].call(
                "PushSparse", codec.encode_parts(meta, [("ids", part), ("grads", grads[where])]), self.rpc_timeout_s
            )
            for shard, where, part in self._split(ids)
        ]

    def riders(self) -> StepRiders:
        """An empty set of row pushes and lookups to send with a step's PushPull."""
        return StepRiders(self._split, len(self.channels), self.codecs, self.compressor)

    def wait_all(self, calls: list) -> None:
        """Wait for calls in flight (e.g. from `push`), all within one deadline."""
        deadline = time.monotonic() + self.rpc_timeout_s
        for call in calls:
            call.wait(max(0.0, deadline - time.monotonic()))

    def _split(self, ids: np.ndarray) -> list[tuple[int, np.ndarray | slice, np.ndarray]]:
        """(shard, positions in ids, ids there) for each shard that holds some of `ids`."""
        if len(self.channels) == 1:  # every id is there: no hashing, no copies
            return [(0, slice(None), ids)] if ids.size else []
        owners = shard_of(ids, len(self.channels))
        return [
            (shard, where, ids[where])
            for shard in range(len(self.channels))
            for where in [np.flatnonzero(owners == shard)]
            if where.size
        ]
