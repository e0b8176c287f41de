"""The shard service: decode a request frame, call the Shard, encode the reply frame.

Transport-neutral (bytes in, bytes out): the gRPC servicer, the tensor stream and the
in-process transport all call it, so every request crosses the same codec. A transport
may pass a `sink` that receives the reply's parts while the shard is locked (the parts
view live values) and writes them where the reply must go, e.g. into shared memory;
the default joins them into bytes. Errors are raised as typed ParamServerError
subclasses; the transport turns them into status codes.

Methods: Hello, Register, PushPull, SetMode, Leave, RegisterTable, Lookup, PushSparse, Checkpoint,
Assign, Shutdown (admin: the node drains and stops). Each request's meta is parsed into its message of
wire/messages.py (a bad field is a MalformedFrameError naming it, before anything changes) and each
reply is built from one; the fields, their meanings and the tensors each frame carries are
documented there (and in docs/protocol.md, generated from them). A PushPull without gradients, row
pushes or "marker" is a plain pull; its parts (dense and riders) are all checked before any is
applied. Compressed gradients (`codecs`, wire/gradient_codec.py) are decoded to float32 first. Thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..base.consistency_spec import ConsistencySpec
from ..base.errors import FailedPreconditionError, MalformedFrameError, NotFoundError
from ..base.metrics import rss_bytes
from ..security.auth import Claim, Guard
from ..wire import codec
from ..wire import messages as msg
from ..wire.gradient_codec import decode_tensors
from .shard import Push, Shard
from .table_store import TableStore

log = logging.getLogger(__name__)
Sink = Callable[[list], Any]


class ShardService:
    """Serves one Shard over any transport."""

    def __init__(
        self,
        shard: Shard,
        tables: TableStore | None = None,
        save_checkpoint: Callable[[str, Shard, TableStore], dict] | None = None,
    ) -> None:
        """`save_checkpoint(name, shard, tables)` writes the shard's file of checkpoint `name` under
        the node's own checkpoint directory and returns its description; it checks the name before
        taking any snapshot. Without it (no checkpoint_dir), a Checkpoint request is refused."""
        self.shard = shard
        self.save_checkpoint = save_checkpoint
        self.tables = tables or TableStore(shard.index)
        self.shard.row_applier = self.tables.apply_rows  # the shard applies row pushes with its steps
        self.announce: dict[str, Any] = {}  # extra Hello fields, e.g. the node's stream port
        self.guard: Guard | None = None  # tokens, roles and audit (transport/dispatch.py), given by the node
        self.on_shutdown: Callable[[bool], None] | None = None  # what Shutdown sets off: the node's drain (restart?)
        self.methods: dict[str, Callable[[bytes, Sink], Any]] = {
            "Hello": self.hello,
            "Register": self.register,
            "PushPull": self.push_pull,
            "SetMode": self.set_mode,
            "Leave": self.leave,
            "RegisterTable": self.register_table,
            "Lookup": self.lookup,
            "PushSparse": self.push_sparse,
            "Checkpoint": self.checkpoint,
            "Assign": self.assign,
            "Shutdown": self.shutdown,
        }

    def call(self, method: str, payload: bytes, sink: Sink = b"".join) -> Any:
        """Handle one request; returns what `sink` made of the reply (by default, its bytes)."""
        handler = self.methods.get(method)
        if handler is None:
            raise NotFoundError(f"shard service has no method {method!r}")
        return handler(payload, sink)

    def claim(self, method: str, payload: bytes) -> Claim:
        """What a request asks for and as which worker (checked against the caller's role before `call`)."""
        if method not in msg.SHARD_METHODS:
            raise NotFoundError(f"shard service has no method {method!r}")
        request = msg.SHARD_METHODS[method][0].from_meta(codec.decode_meta(payload))
        worker = getattr(request, "worker", None)
        if isinstance(request, msg.LeaveRequest) and request.gone is not None:
            return Claim("Forget", worker, {"gone": request.gone})
        if isinstance(request, msg.SetModeRequest):
            return Claim(method, worker, {"consistency": request.consistency})
        if isinstance(request, msg.CheckpointRequest):
            return Claim(method, worker, {"name": request.name})
        if isinstance(request, msg.ShutdownRequest):
            return Claim("Restart" if request.restart else method, worker, {"reason": request.reason})
        return Claim(method, worker)

    def hello(self, payload: bytes, sink: Sink) -> Any:
        request = msg.HelloRequest.from_meta(codec.decode(payload).meta)
        reply = msg.HelloReply(
            shard=self.shard.index,
            protocol=[codec.PROTOCOL_MAJOR, codec.PROTOCOL_MINOR],
            **self.shard.describe(),
            tables=self.tables.describe(),
            rss_bytes=rss_bytes() if request.process else None,
            **self.announce,
        )
        return sink(codec.encode_parts(reply.to_meta()))

    def register(self, payload: bytes, sink: Sink) -> Any:
        frame = codec.decode(payload)
        request = msg.RegisterRequest.from_meta(frame.meta)
        spec = ConsistencySpec.from_dict(request.consistency) if request.consistency is not None else None
        self.shard.register(request.group, request.optimizer, frame.tensors, spec, request.worker, request.dtypes)
        self.shard.open_session(request.worker)
        position, restored = self.shard.position(request.worker), self.shard.restored_position(request.worker)
        return self.shard.pull(
            frame.tensors,
            _reply(sink, lambda version: msg.RegisterReply(version=version, position=position, restored=restored)),
        )

    def push_pull(self, payload: bytes, sink: Sink) -> Any:
        frame = codec.decode(payload)
        request = msg.PushPullRequest.from_meta(frame.meta)
        # compressed gradients become float32 first: every check below sees what is applied
        frame.tensors = decode_tensors(frame.tensors, request.codecs)
        # row pushes and lookups riding along: all checked before anything changes
        row_pushes = [
            self.tables.check_push(table, _take(frame, ids), _take(frame, grads))
            for table, ids, grads in request.sparse
        ]
        lookups = [(rows, self.tables.check_lookup(table, _take(frame, ids))) for table, ids, rows in request.lookup]
        self.shard.check_known(frame.tensors if request.pull is None else request.pull)
        step, staleness, applied = self.shard.sync_step, 0, False
        if frame.tensors or row_pushes or request.marker:
            push = Push(
                frame.tensors, request.lr, request.worker, request.step, request.base, row_pushes, request.resumed
            )
            outcome = self.shard.push(push)
            step, staleness, applied = self.shard.sync_step, outcome.staleness, outcome.applied
        found = self.tables.lookup_checked([lookup for _, lookup in lookups])
        rows = [(name, array) for (name, _), array in zip(lookups, found)]
        return self.shard.pull(
            frame.tensors if request.pull is None else request.pull,
            _reply(
                sink,
                lambda version: msg.PushPullReply(version=version, step=step, staleness=staleness, applied=applied),
                rows,
            ),
        )

    def register_table(self, payload: bytes, sink: Sink) -> Any:
        request = msg.RegisterTableRequest.from_meta(codec.decode(payload).meta)
        spec = ConsistencySpec.from_dict(request.consistency) if request.consistency is not None else None
        if spec is not None:
            self.shard.check_mode(spec)  # adopted only once the table is registered: a refusal changes nothing
        self.tables.register(
            request.table,
            request.dim,
            request.optimizer,
            request.init,
            request.policy,
            request.capacity,
            request.num_shards,
            request.dtype,
        )
        self.shard.open_session(request.worker)
        if spec is not None:
            self.shard.adopt_mode(spec)
        return sink(codec.encode_parts(msg.RegisterTableReply().to_meta()))

    def lookup(self, payload: bytes, sink: Sink) -> Any:
        frame = codec.decode(payload)
        request = msg.LookupRequest.from_meta(frame.meta)
        rows = self.tables.lookup(request.table, _tensor(frame, "ids"))
        return sink(codec.encode_parts(msg.LookupReply().to_meta(), [("rows", rows)]))

    def checkpoint(self, payload: bytes, sink: Sink) -> Any:
        request = msg.CheckpointRequest.from_meta(codec.decode(payload).meta)
        if self.save_checkpoint is None:
            raise FailedPreconditionError(f"shard {self.shard.index} was started without a checkpoint_dir")
        entry = self.save_checkpoint(request.name, self.shard, self.tables)
        return sink(codec.encode_parts(msg.CheckpointReply(**entry).to_meta()))

    def assign(self, payload: bytes, sink: Sink) -> Any:
        frame = codec.decode(payload)
        msg.AssignRequest.from_meta(frame.meta)
        version = self.shard.assign(frame.tensors)
        return sink(codec.encode_parts(msg.AssignReply(version=version).to_meta()))

    def shutdown(self, payload: bytes, sink: Sink) -> Any:
        request = msg.ShutdownRequest.from_meta(codec.decode(payload).meta)
        if self.on_shutdown is None:
            raise FailedPreconditionError(f"shard {self.shard.index} is not a node that can be shut down remotely")
        log.info(
            "shard %d: %s asked%s",
            self.shard.index,
            "restart" if request.restart else "shutdown",
            f": {request.reason}" if request.reason else "",
        )
        version = self.shard.version
        self.on_shutdown(request.restart)  # only sets a flag: the node drains after this reply is sent
        return sink(codec.encode_parts(msg.ShutdownReply(version=version).to_meta()))

    def push_sparse(self, payload: bytes, sink: Sink) -> Any:
        frame = codec.decode(payload)
        request = msg.PushSparseRequest.from_meta(frame.meta)
        self.tables.push(request.table, _tensor(frame, "ids"), _tensor(frame, "grads"))
        return sink(codec.encode_parts(msg.PushSparseReply().to_meta()))

    def leave(self, payload: bytes, sink: Sink) -> Any:
        request = msg.LeaveRequest.from_meta(codec.decode(payload).meta)
        if request.gone is None:
            self.shard.leave(request.worker, request.barrier)
        else:
            self.shard.forget(request.worker, request.gone)
        return sink(codec.encode_parts(msg.LeaveReply(version=self.shard.version, step=self.shard.sync_step).to_meta()))

    def set_mode(self, payload: bytes, sink: Sink) -> Any:
        request = msg.SetModeRequest.from_meta(codec.decode(payload).meta)
        self.shard.set_mode(ConsistencySpec.from_dict(request.consistency))
        return sink(
            codec.encode_parts(msg.SetModeReply(version=self.shard.version, step=self.shard.sync_step).to_meta())
        )


def _reply(sink: Sink, build: Callable[[int], msg.Message], more: list | None = None) -> Callable[[int, list], Any]:
    """What Shard.pull calls with the version and the values, under the shard's lock."""
    return lambda version, values: sink(codec.encode_parts(build(version).to_meta(), [*values, *(more or ())]))


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
