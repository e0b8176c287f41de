"""The shard service: decode a request frame, call the Shard, encode the reply frame.

Transport-neutral (bytes in, bytes out): the gRPC servicer, the tensor stream and the
in-process transport all call it, so every request crosses the same codec. A transport
may pass a `sink` that receives the reply's parts while the shard is locked (the parts
view live values) and writes them where the reply must go, e.g. into shared memory;
the default joins them into bytes. Errors are raised as typed ParamServerError
subclasses; the transport turns them into status codes.

Methods (request meta -> reply meta; tensors as named):
- ``Hello``: {} -> {"shard", "protocol", "stream_port"?, "host_id"?} + the shard's counters
- ``Register``: {"group", "optimizer", "consistency"?} + initial values -> {"version"} + current values
- ``PushPull``: {"lr"?: {group: lr}, "pull"?: [names], "worker"?, "step"?, "base"?, "resumed"?} + gradients
  -> {"version", "step", "staleness", "applied"} + values of the pulled names (default: the
  pushed names). With no gradients it is a plain pull. Embedding work may ride along:
  "sparse": [[table, ids name, grads name]] (row pushes) and "lookup": [[table, ids name,
  rows name]] (rows read after the pushes, returned under the rows name); rider tensors are
  named "~...". Every part is checked before any is applied. Row pushes count as a push of the
  worker's step (applied on arrival, or averaged over a sync step's workers); "marker": true
  makes a request without gradients count as one too (a worker with nothing for this shard
  this step, so that a sync step does not wait for it).
- ``SetMode``: {"consistency"} -> {"version", "step"}
- ``Leave``: {"worker", "barrier"?, "gone"?} -> {"version", "step"}: the worker finished its data,
  or waits at "barrier"; steps stop waiting for it until its next push, or until a push that
  carries "resumed": that barrier (it opened). With "gone" (why), the coordinator found it gone
  for good: a wait that needs it fails at once, naming it
- ``RegisterTable``: {"table", "dim", "optimizer", "init", "policy"?} -> {}
- ``Lookup``: {"table"} + "ids" (int64, distinct) -> {} + "rows" (len(ids) x dim float32)
- ``PushSparse``: {"table"} + "ids", "grads" -> {}
- ``Checkpoint``: {"dir", "name"} -> {"index", "file", "bytes", "sha256"}: this shard's file of
  checkpoint `name`, written to `dir` (a path or fsspec URL)
``Register`` (meta may name the "worker") replies also carry "restored", that worker's step in
the checkpoint the shard started from (0: none), and "position", the steps that worker trained as
the shard saw them.
``RegisterTable`` may carry "capacity", "num_shards" (the shards the table spreads over) and
"consistency" (the mode, for a shard that holds no dense variable to learn it from).
Thread-safe.
"""

from __future__ import annotations

from typing import Any, Callable

from ..base.consistency_spec import ConsistencySpec
from ..base.errors import FailedPreconditionError, MalformedFrameError, NotFoundError
from ..transport import codec
from .shard import Push, Shard
from .table_store import TableStore

Sink = Callable[[list], Any]


class ShardService:
    """Serves one Shard over any transport."""

    def __init__(self, shard: Shard, tables: TableStore | None = None,
                 save_checkpoint: Callable[[str, str, Shard, TableStore], dict] | None = None) -> None:
        """`save_checkpoint(dir, name, shard, tables)` writes the shard's checkpoint file and
        returns its description; without it, a Checkpoint request is refused."""
        self.shard = shard
        self.save_checkpoint = save_checkpoint
        self.tables = tables or TableStore(shard.index)
        self.shard.row_applier = self.tables.apply_rows  # the shard applies row pushes with its steps
        self.announce: dict[str, Any] = {}  # extra Hello fields, e.g. the node's stream port
        self.methods: dict[str, Callable[[bytes, Sink], Any]] = {
            "Hello": self.hello, "Register": self.register, "PushPull": self.push_pull, "SetMode": self.set_mode,
            "Leave": self.leave, "RegisterTable": self.register_table, "Lookup": self.lookup,
            "PushSparse": self.push_sparse, "Checkpoint": self.checkpoint}

    def call(self, method: str, payload: bytes, sink: Sink = b"".join) -> Any:
        """Handle one request; returns what `sink` made of the reply (by default, its bytes)."""
        handler = self.methods.get(method)
        if handler is None:
            raise NotFoundError(f"shard service has no method {method!r}")
        return handler(payload, sink)

    def hello(self, payload: bytes, sink: Sink) -> Any:
        codec.decode(payload)
        meta = {"shard": self.shard.index, "protocol": [codec.PROTOCOL_MAJOR, codec.PROTOCOL_MINOR],
                **self.shard.describe(), "tables": self.tables.describe(), **self.announce}
        return sink(codec.encode_parts(meta))

    def register(self, payload: bytes, sink: Sink) -> Any:
        frame = codec.decode(payload)
        group = _field(frame.meta, "group", str)
        optimizer = _field(frame.meta, "optimizer", dict)
        consistency = frame.meta.get("consistency")
        spec = ConsistencySpec.from_dict(consistency) if isinstance(consistency, dict) else None
        worker = _optional_int(frame.meta, "worker")
        self.shard.register(group, optimizer, frame.tensors, spec, worker)
        extra = {"position": self.shard.position(worker), "restored": self.shard.restored_position(worker)}
        return self.shard.pull(frame.tensors, _reply(sink, extra))

    def push_pull(self, payload: bytes, sink: Sink) -> Any:
        frame = codec.decode(payload)
        meta = frame.meta
        lrs = meta.get("lr") or {}
        names = meta.get("pull")
        if not isinstance(lrs, dict) or not (names is None or isinstance(names, list)):
            raise MalformedFrameError("PushPull meta: 'lr' must be an object and 'pull' a list of names")
        # row pushes and lookups riding along: all checked before anything changes
        row_pushes = [self.tables.check_push(table, _take(frame, ids), _take(frame, grads))
                      for table, ids, grads in _rider_entries(meta, "sparse")]
        lookups = [(rows, self.tables.check_lookup(table, _take(frame, ids)))
                   for table, ids, rows in _rider_entries(meta, "lookup")]
        extra = {"step": self.shard.sync_step, "staleness": 0, "applied": False}
        if frame.tensors or row_pushes or meta.get("marker"):
            push = Push(frame.tensors, lrs, _optional_int(meta, "worker"), _optional_int(meta, "step"),
                        _optional_int(meta, "base"), row_pushes, _optional_str(meta, "resumed"))
            outcome = self.shard.push(push)
            extra = {"step": self.shard.sync_step, "staleness": outcome.staleness, "applied": outcome.applied}
        found = self.tables.lookup_checked([lookup for _, lookup in lookups])
        rows = [(name, array) for (name, _), array in zip(lookups, found)]
        return self.shard.pull(frame.tensors if names is None else names, _reply(sink, extra, rows))

    def register_table(self, payload: bytes, sink: Sink) -> Any:
        meta = codec.decode(payload).meta
        consistency = meta.get("consistency")
        if isinstance(consistency, dict):
            self.shard.adopt_mode(ConsistencySpec.from_dict(consistency))
        policy = meta.get("policy")
        self.tables.register(_field(meta, "table", str), _field(meta, "dim", int), _field(meta, "optimizer", dict),
                             _field(meta, "init", dict), policy if isinstance(policy, dict) else None,
                             _field(meta, "capacity", int) if "capacity" in meta else 0,
                             _field(meta, "num_shards", int) if "num_shards" in meta else 1)
        return sink(codec.encode_parts({}))

    def lookup(self, payload: bytes, sink: Sink) -> Any:
        frame = codec.decode(payload)
        rows = self.tables.lookup(_field(frame.meta, "table", str), _tensor(frame, "ids"))
        return sink(codec.encode_parts({}, [("rows", rows)]))

    def checkpoint(self, payload: bytes, sink: Sink) -> Any:
        meta = codec.decode(payload).meta
        directory, name = _field(meta, "dir", str), _field(meta, "name", str)
        if self.save_checkpoint is None:
            raise FailedPreconditionError(f"shard {self.shard.index} was started without a checkpoint writer")
        return sink(codec.encode_parts(self.save_checkpoint(directory, name, self.shard, self.tables)))

    def push_sparse(self, payload: bytes, sink: Sink) -> Any:
        frame = codec.decode(payload)
        self.tables.push(_field(frame.meta, "table", str), _tensor(frame, "ids"), _tensor(frame, "grads"))
        return sink(codec.encode_parts({}))

    def leave(self, payload: bytes, sink: Sink) -> Any:
        frame = codec.decode(payload)
        worker = _optional_int(frame.meta, "worker")
        if worker is None:
            raise MalformedFrameError("Leave needs the worker's index")
        gone = _optional_str(frame.meta, "gone")
        if gone is None:
            self.shard.leave(worker, _optional_str(frame.meta, "barrier"))
        else:
            self.shard.forget(worker, gone)
        return sink(codec.encode_parts({"version": self.shard.version, "step": self.shard.sync_step}))

    def set_mode(self, payload: bytes, sink: Sink) -> Any:
        frame = codec.decode(payload)
        self.shard.set_mode(ConsistencySpec.from_dict(_field(frame.meta, "consistency", dict)))
        return sink(codec.encode_parts({"version": self.shard.version, "step": self.shard.sync_step}))


def _reply(sink: Sink, extra: dict | None = None, more: list | None = None) -> Callable[[int, list], Any]:
    return lambda version, values: sink(codec.encode_parts({"version": version, **(extra or {})},
                                                           [*values, *(more or ())]))


def _rider_entries(meta: dict[str, Any], key: str) -> list[list[str]]:
    """PushPull meta "sparse" / "lookup": lists of three names, [table, tensor, tensor]."""
    entries = meta.get(key) or []
    if not isinstance(entries, list) or not all(
            isinstance(e, list) and len(e) == 3 and all(isinstance(n, str) for n in e) for e in entries):
        raise MalformedFrameError(f"PushPull meta {key!r} must be a list of [table, name, name]")
    return entries


def _take(frame: codec.Frame, name: str):
    """Remove and return a rider tensor (what stays in the frame is the dense push)."""
    if not name.startswith("~"):
        raise MalformedFrameError(f"rider tensor names start with '~', got {name!r}")
    tensor = _tensor(frame, name)
    del frame.tensors[name]
    return tensor


def _tensor(frame: codec.Frame, name: str):
    if name not in frame.tensors:
        raise MalformedFrameError(f"request needs a tensor named {name!r}")
    return frame.tensors[name]


def _optional_int(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise MalformedFrameError(f"request meta {key!r} must be an integer, got {value!r}")
    return value


def _optional_str(meta: dict[str, Any], key: str) -> str | None:
    value = meta.get(key)
    if value is not None and not isinstance(value, str):
        raise MalformedFrameError(f"request meta {key!r} must be a string, got {value!r}")
    return value


def _field(meta: dict[str, Any], key: str, kind: type) -> Any:
    value = meta.get(key)
    if not isinstance(value, kind):
        raise MalformedFrameError(f"request meta needs {key!r} as {kind.__name__}, got {value!r}")
    return value
