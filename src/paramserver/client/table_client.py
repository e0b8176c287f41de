"""The worker's side of embedding tables: ids routed to shards by hash, rows gathered back.

Every shard holds a part of every table; an id lives on shard `mix64(id) % num_shards`, so
the same id always meets the same row. Thread-safety as PSClient: one training thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from paramserver.base.compression_spec import NONE, Codec
from paramserver.base.errors import InvalidArgumentError, ParamServerError, RollbackError, UnavailableError
from paramserver.base.hashing import shard_of
from paramserver.client.compression import GradientCompressor
from paramserver.transport.channel import ShardChannel
from paramserver.wire import messages as msg
from paramserver.wire.calls import Pending, gather
from paramserver.wire.stubs import ShardStub

T = TypeVar("T")
Piece = tuple[int, np.ndarray | slice, np.ndarray]  # (shard, positions in the ids, the ids it holds)
_PLACEMENTS_KEPT = 16  # a step's lookups and pushes of every table, with room to spare


class RowsHandle:
    """The rows of a lookup in flight. `wait()` gathers them, within the lookup's deadline."""

    def __init__(self, calls: list[tuple[np.ndarray | slice, Pending[msg.LookupReply]]], count: int, timeout: float):
        self._calls, self._count, self._timeout = calls, count, timeout

    def wait(self) -> np.ndarray:
        replies = gather([call for _, call in self._calls], self._timeout)
        return _joined(
            self._count, ((where, tensors["rows"]) for (where, _), (_, tensors) in zip(self._calls, replies))
        )


def _joined(count: int, pieces) -> np.ndarray:
    """(count x dim) rows put together from each shard's (positions, rows), in their wire dtype."""
    rows = None
    for where, got in pieces:
        if rows is None:
            rows = np.empty((count, got.shape[1]), got.dtype)
        rows[where] = got
    return rows if rows is not None else np.empty((0, 0), np.float32)


@dataclass
class StepRows:
    """One shard's part of a step's embedding work: its PushPullRequest `rows` and `lookups`, the
    tensors they name, and the encodings of compressed row gradients (by tensor name)."""

    pushes: list[msg.RowPush] = field(default_factory=list)
    lookups: list[msg.RowLookup] = field(default_factory=list)
    tensors: list[tuple[str, np.ndarray]] = field(default_factory=list)
    codecs: dict[str, dict] = field(default_factory=dict)


NO_ROWS = StepRows()  # a shard's part of a step without embedding work; shared: never changed


class StepRiders:
    """Row pushes and lookups that ride along a step's PushPull, so that one request per shard
    carries the dense gradients, the row gradients and the next batch's lookups together.

    Per shard, a StepRows: the request's `rows` (RowPush: table, ids tensor, grads tensor) and
    `lookups` (RowLookup: table, ids tensor, rows name), named `r<n>.ids`, `r<n>.grads`, `l<n>.ids`,
    `l<n>.rows` (a variable's part names start with its optimizer's name: never these).
    The shard applies the row pushes with the dense push and reads the lookups after both, so
    the rows include this step's update. Row gradients are encoded by their table's codec.
    Built by TableClient.riders(); not thread-safe.
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
        self._by_shard: dict[int, StepRows] = {}
        self._lookups: list[tuple[int, list[tuple[int, np.ndarray, str]]]] = []  # (count, [(shard, where, rows name)])

    def on(self, shard: int) -> StepRows:
        """What rides to `shard` (NO_ROWS if nothing: read it, never change it)."""
        return self._by_shard.get(shard) or NO_ROWS

    def push(self, table: str, ids: np.ndarray, grads: np.ndarray) -> None:
        """Add a row push. Every shard gets one, empty where it holds none of `ids`: each shard
        counts the table's steps, and torch counts a step whenever the table has a gradient."""
        parts = {shard: (where, part) for shard, where, part in self._split(ids)}
        codec = self._table_codecs.get(table, NONE)
        for shard in range(self._num_shards):
            where, part = parts.get(shard, (slice(0, 0), ids[:0]))
            rows = self._by_shard.setdefault(shard, StepRows())
            name = f"r{len(rows.pushes)}"
            rows.pushes.append(msg.RowPush(table, name + ".ids", name + ".grads"))
            rows.tensors.append((name + ".ids", part))
            self._add_grads(rows, codec, name + ".grads", grads[where])

    def _add_grads(self, rows: StepRows, codec: Codec, name: str, grads: np.ndarray) -> None:
        """A row push's gradients, encoded by its table's codec; without one they go as they are,
        the compressor not called (only counting their bytes)."""
        if codec == NONE:
            self._compressor.gradient_bytes += grads.nbytes
            rows.tensors.append((name, grads))
            return
        header, encoded = self._compressor.encode_rows(codec, name, grads)
        rows.tensors.extend(encoded)
        if header is not None:
            rows.codecs[name] = header

    def lookup(self, table: str, ids: np.ndarray) -> int:
        """Add a lookup of distinct `ids`; returns its index in `rows()`."""
        placed = []
        for shard, where, part in self._split(ids):
            rows = self._by_shard.setdefault(shard, StepRows())
            name = f"l{len(rows.lookups)}"
            rows.lookups.append(msg.RowLookup(table, name + ".ids", name + ".rows"))
            rows.tensors.append((name + ".ids", part))
            placed.append((shard, where, name + ".rows"))
        self._lookups.append((ids.shape[0], placed))
        return len(self._lookups) - 1

    def rows(self, replies: dict[int, dict[str, np.ndarray]]) -> list[np.ndarray]:
        """The rows of each lookup (copies), from each shard's reply tensors."""
        return [
            _joined(count, ((where, replies[shard][name]) for shard, where, name in placed))
            for count, placed in self._lookups
        ]


class TableClient:
    """Registers tables, looks rows up, pushes row gradients."""

    def __init__(
        self,
        channels: list[ShardChannel],
        rpc_timeout_s: float,
        consistency: dict | None = None,
        worker: int | None = None,
        compressor: GradientCompressor | None = None,
        on_registered: Callable[[list[msg.RegisterTableReply]], None] | None = None,
    ) -> None:
        self.channels = channels
        self.stubs = [ShardStub(channel) for channel in channels]
        self.compressor = compressor or GradientCompressor()  # a PSClient's: one count of gradient bytes
        self.codecs: dict[str, Codec] = {}  # by table: how row gradients riding along a step are encoded
        self.rpc_timeout_s = rpc_timeout_s
        self.consistency = consistency  # the mode, told to shards that hold no dense variable
        self.worker = worker  # named when registering: a PS node accepts pushes only from workers that registered
        # the latest placements of read-only ids arrays: a batch's ids are hashed once, at their lookup, and
        # the push of the same array (HashEmbedding hands it back with its gradients) reuses the placement
        self._placed: OrderedDict[int, tuple[np.ndarray, list[Piece]]] = OrderedDict()
        self._requests: list[msg.RegisterTableRequest] = []  # every table registered, in order
        # partial recovery: called when a lookup finds a shard gone; it brings the shard back, the lookup is sent again
        self.on_lost: Callable[[ParamServerError], None] | None = None
        # given every shard's RegisterTable replies: the worker's data position, as Register's replies give
        # it (PushRecord.note_position), so that a model of tables only resumes its data too
        self.on_registered = on_registered

    def replace_channel(self, shard: int, channel: ShardChannel) -> None:
        """Talk to `shard` through `channel` from now on (its process restarted; PSClient closes the old one)."""
        self.channels[shard] = channel
        self.stubs[shard] = ShardStub(channel)

    def register_again(self, shard: int, timeout: float) -> int:
        """Register every table with `shard` again (a new process: it restores them from its checkpoint);
        returns this worker's position as the shard counts it (0: no table)."""
        position = 0
        for request in self._requests:
            reply, _ = self.stubs[shard].register_table(request, timeout).wait(timeout)
            position = max(position, reply.position)
        return position

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
        `compression`: how a float32 table's row gradients ride along steps (a codec whose `for_tables`
        is true; StepRiders)."""
        if not compression.for_tables:
            raise InvalidArgumentError(
                f"table {table!r}: {compression.kind} compresses dense gradients only, not a table's row gradients"
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
        replies = gather([stub.register_table(request, self.rpc_timeout_s) for stub in self.stubs], self.rpc_timeout_s)
        self.codecs[table] = compression
        self._requests.append(request)
        if self.on_registered is not None:
            self.on_registered([reply for reply, _ in replies])

    def lookup(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Rows (len(ids) x dim) of distinct int64 `ids`, in their order; missing rows are created."""
        return self._again_if_lost(lambda: self.start_lookup(table, ids).wait())

    def _again_if_lost(self, call: Callable[[], T]) -> T:
        """`call()`; with `on_lost`, once more after a shard that was gone is back (partial recovery)."""
        try:
            return call()
        except (UnavailableError, RollbackError) as exc:
            if self.on_lost is None:
                raise
            self.on_lost(exc)
        return call()

    def start_lookup(self, table: str, ids: np.ndarray) -> RowsHandle:
        """Send a lookup and return at once; `wait()` on the handle gives the rows."""
        request = msg.LookupRequest(table=table)
        calls = [
            (where, self.stubs[shard].lookup(request, self.rpc_timeout_s, [("ids", part)]))
            for shard, where, part in self._split(ids)
        ]
        return RowsHandle(calls, ids.shape[0], self.rpc_timeout_s)

    def lookup_many(self, lookups: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        """The rows of several (table, distinct ids) lookups, in their order: one PushPull per shard
        involved, carrying every table's lookup and nothing else (no push, no step marker: a sync
        step waits for no one), so that a collection of tables costs one round trip."""
        if len(lookups) == 1:
            return [self.lookup(*lookups[0])]
        return self._again_if_lost(lambda: self._lookup_many(lookups))

    def _lookup_many(self, lookups: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        riders = self.riders()
        for table, ids in lookups:
            riders.lookup(table, ids)
        calls = []
        for shard in range(len(self.channels)):
            rows = riders.on(shard)
            if rows.lookups:
                request = msg.PushPullRequest(pull=[], worker=self.worker, lookups=rows.lookups)
                calls.append((shard, self.stubs[shard].push_pull(request, self.rpc_timeout_s, rows.tensors)))
        replies = gather([call for _, call in calls], self.rpc_timeout_s)
        return riders.rows({shard: tensors for (shard, _), (_, tensors) in zip(calls, replies)})

    def riders(self) -> StepRiders:
        """An empty set of row pushes and lookups to send with a step's PushPull."""
        return StepRiders(self._split, len(self.channels), self.codecs, self.compressor)

    def _split(self, ids: np.ndarray) -> list[Piece]:
        """(shard, positions in ids, ids there) for each shard that holds some of `ids`. The placement of a
        read-only array that owns its data is kept for a while and reused for the same object: its ids
        cannot have changed in between (HashEmbedding's distinct ids are such arrays)."""
        if len(self.channels) == 1:  # every id is there: no hashing, no copies
            return [(0, slice(None), ids)] if ids.size else []
        placed = self._placed.get(id(ids))
        if placed is not None and placed[0] is ids:
            return placed[1]
        pieces = self._place(ids)
        if ids.flags.writeable or ids.base is not None:
            return pieces
        self._placed[id(ids)] = (ids, pieces)  # holds the array: its id is not reused while it is here
        if len(self._placed) > _PLACEMENTS_KEPT:
            self._placed.popitem(last=False)
        return pieces

    def _place(self, ids: np.ndarray) -> list[Piece]:
        owners = shard_of(ids, len(self.channels))
        return [
            (shard, where, ids[where])
            for shard in range(len(self.channels))
            for where in [np.flatnonzero(owners == shard)]
            if where.size
        ]
