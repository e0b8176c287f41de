"""The shard service: a decoded request (wire/calls.py) in, the Shard's answer out as a reply frame.

Transport-neutral: the gRPC servicer, the tensor stream and the in-process transport all reach it
through transport/dispatch.py, which decodes each request frame once (`decode`), checks the
caller's claim (`claim`) and then has it served (`serve`). A transport may pass a `sink` that
receives the reply's parts while the shard is locked (the parts view live values) and writes them
where the reply must go, e.g. into shared memory; the default joins them into bytes. Errors are
raised as typed ParamServerError subclasses; the transport turns them into status codes.

Methods: Hello, Register, PushPull, SetMode, Leave, RegisterTable, Lookup, Checkpoint, Assign,
Shutdown (admin: the node drains and stops), Prove (needs no token: the node answers a challenge with
its run's secret, security/run_secret.py). Requests and replies are the messages of
wire/messages.py (docs/protocol.md is generated from them). A PushPull is one training step
(Shard.step): compressed gradients (`codecs`, wire/gradient_codec.py) are decoded to float32 here,
everything else is the Shard's. Thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from paramserver.base.consistency_spec import ConsistencySpec
from paramserver.base.errors import FailedPreconditionError, MalformedFrameError
from paramserver.base.metrics import CallMetrics, rss_bytes
from paramserver.security.auth import Claim, Guard
from paramserver.security.run_secret import RunSecret, ps_node
from paramserver.server.shard import Shard, Step, StepOutcome
from paramserver.wire import codec
from paramserver.wire import messages as msg
from paramserver.wire.calls import Request, decode_request
from paramserver.wire.gradient_codec import decode_tensors
from paramserver.wire.half import to_wire

log = logging.getLogger(__name__)
SERVICE = "paramserver.Shard"
Sink = Callable[[list], Any]


class CheckpointWrites(Protocol):
    """Where a Checkpoint call goes (checkpoint/shard_writes.py): each method returns a manifest entry or raises."""

    def __call__(self, name: str, shard: Shard, parent: str = "") -> dict[str, Any]: ...

    def begin(self, name: str, shard: Shard, parent: str = "") -> bool: ...

    def collect(self, name: str, wait_s: float) -> dict[str, Any] | int: ...


class ShardService:
    """Serves one Shard (and its tables) over any transport."""

    def __init__(self, shard: Shard, save_checkpoint: CheckpointWrites | None = None) -> None:
        """`save_checkpoint`: the shard's file of a checkpoint written under the node's own checkpoint
        directory (checkpoint/shard_writes.py: within the call, or begun and collected); it checks the name
        before taking any snapshot. Without it (no checkpoint_dir), a Checkpoint request is refused."""
        self.shard = shard
        self.save_checkpoint = save_checkpoint
        self.announce: dict[str, Any] = {}  # extra Hello fields, e.g. the node's stream port
        self.calls: CallMetrics | None = None  # per-call metrics (transport/dispatch.py), given by the node
        self.guard: Guard | None = (
            None  # security.auth.Guard: tokens, roles and audit (transport/dispatch.py), given by the node
        )
        self.on_shutdown: Callable[[bool], None] | None = None  # what Shutdown sets off: the node's drain (restart?)
        self.run_secret: RunSecret | None = None  # the secret of the run that started the node, given by it (Prove)
        self.methods: dict[str, Callable[[Any, dict[str, np.ndarray], Sink], Any]] = {
            "Hello": self.hello,
            "Register": self.register,
            "PushPull": self.push_pull,
            "SetMode": self.set_mode,
            "Leave": self.leave,
            "RegisterTable": self.register_table,
            "Lookup": self.lookup,
            "Checkpoint": self.checkpoint,
            "Assign": self.assign,
            "Shutdown": self.shutdown,
            "Prove": self.prove,
            "Probe": self.probe,
        }
        self._probe_reply = np.zeros(0, np.uint8)  # zeros a Probe reply carries, grown to the largest asked

    @property
    def tables(self):
        return self.shard.tables

    def decode(self, method: str, payload: Any) -> Request:
        """The request frame, decoded once (NOT_FOUND for an unknown method, MALFORMED naming a bad field)."""
        return decode_request("shard service", msg.SHARD_METHODS, method, payload)

    def serve(self, request: Request, sink: Sink = b"".join) -> Any:
        """Handle one decoded request; returns what `sink` made of the reply (by default, its bytes)."""
        return self.methods[request.method](request.message, request.tensors, sink)

    def call(self, method: str, payload: Any, sink: Sink = b"".join) -> Any:
        """Decode and serve one request frame (what dispatch does, less the guard)."""
        return self.serve(self.decode(method, payload), sink)

    def claim(self, request: Request) -> Claim:
        """What a request asks for and as which worker (checked against the caller's role before `serve`)."""
        message, method = request.message, request.method
        worker = getattr(message, "worker", None)
        if isinstance(message, msg.LeaveRequest) and message.gone is not None:
            return Claim("Forget", worker, {"gone": message.gone})
        if isinstance(message, msg.SetModeRequest):
            return Claim(method, worker, {"consistency": message.consistency})
        if isinstance(message, msg.CheckpointRequest):
            return Claim(method, worker, {"name": message.name})
        if isinstance(message, msg.ShutdownRequest):
            action = "Restart" if message.restart else "End" if message.end else method
            return Claim(action, worker, {"reason": message.reason})
        return Claim(method, worker)

    def for_anonymous(self, request: Request) -> Request:
        """What a caller no token names, from another host, may ask (transport/dispatch.py): a Hello
        says nothing of the serving process (its memory); the rest is what a client needs to connect."""
        if isinstance(request.message, msg.HelloRequest) and request.message.process:
            return dataclasses.replace(request, message=dataclasses.replace(request.message, process=False))
        return request

    def hello(self, request: msg.HelloRequest, tensors: dict, sink: Sink) -> Any:
        reply = msg.HelloReply(
            shard=self.shard.index,
            protocol=[codec.PROTOCOL_MAJOR, codec.PROTOCOL_MINOR],
            **self.shard.describe(),
            tables=self.tables.describe(),
            rss_bytes=rss_bytes() if request.process else None,
            restored_from=self.shard.restore.name if self.shard.restore is not None else None,
            **self.announce,
        )
        return _send(sink, reply)

    def register(self, request: msg.RegisterRequest, tensors: dict, sink: Sink) -> Any:
        spec = ConsistencySpec.from_dict(request.consistency) if request.consistency is not None else None
        self.shard.register(request.group, request.optimizer, tensors, spec, request.worker, request.dtypes)
        self.shard.open_session(request.worker)
        position, restored = self.shard.position(request.worker), self.shard.restored_position(request.worker)
        return self.shard.pull(
            tensors,
            lambda version, values: _send(
                sink, msg.RegisterReply(version=version, position=position, restored=restored), values
            ),
        )

    def push_pull(self, request: msg.PushPullRequest, tensors: dict, sink: Sink) -> Any:
        # compressed gradients become float32 first: every check of the step sees what is applied
        if request.codecs:
            tensors = decode_tensors(tensors, request.codecs)
        grads = _gradients(tensors, request)
        step = Step(
            grads=grads,
            pull=list(grads) if request.pull is None else request.pull,
            row_pushes=[
                (push.table, _tensor(tensors, push.ids, "rows"), _tensor(tensors, push.grads, "rows"))
                for push in request.rows
            ],
            lookups=[(lookup.table, _tensor(tensors, lookup.ids, "lookups")) for lookup in request.lookups],
            lrs=request.lr,
            worker=request.worker,
            step=request.step,
            base_version=request.base,
            resumed=request.resumed,
            marker=request.marker,
        )
        names = [lookup.rows for lookup in request.lookups]
        pull_as = request.pull_as

        def reply(outcome: StepOutcome, values: list, rows: list[np.ndarray]) -> Any:
            if pull_as is not None:  # float32 values as half precision: half the bytes back
                values = [(name, to_wire(v, pull_as) if v.dtype == np.float32 else v) for name, v in values]
            answer = msg.PushPullReply(
                version=outcome.version, step=outcome.sync_step, staleness=outcome.staleness, applied=outcome.applied
            )
            return _send(sink, answer, [*values, *zip(names, rows)])

        return self.shard.step(step, reply)

    def register_table(self, request: msg.RegisterTableRequest, tensors: dict, sink: Sink) -> Any:
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
        # the worker's data position, as Register's reply says it: a model of tables only resumes there too
        reply = msg.RegisterTableReply(
            position=self.shard.position(request.worker), restored=self.shard.restored_position(request.worker)
        )
        return _send(sink, reply)

    def probe(self, request: msg.ProbeRequest, tensors: dict, sink: Sink) -> Any:
        payload = tensors.get("payload")
        if payload is not None and (payload.dtype != np.uint8 or payload.size > msg.PROBE_MAX_BYTES):
            raise MalformedFrameError(f"Probe payload must be uint8, at most {msg.PROBE_MAX_BYTES} bytes")
        if self._probe_reply.size < request.reply_bytes:
            self._probe_reply = np.zeros(request.reply_bytes, np.uint8)  # read-only from here: shared by calls
        return _send(sink, msg.ProbeReply(), [("payload", self._probe_reply[: request.reply_bytes])])

    def lookup(self, request: msg.LookupRequest, tensors: dict, sink: Sink) -> Any:
        rows = self.tables.lookup(request.table, _tensor(tensors, "ids", "Lookup"))
        return _send(sink, msg.LookupReply(), [("rows", rows)])

    def checkpoint(self, request: msg.CheckpointRequest, tensors: dict, sink: Sink) -> Any:
        writes = self.save_checkpoint
        if writes is None:
            raise FailedPreconditionError(f"shard {self.shard.index} was started without a checkpoint_dir")
        if request.collect:
            entry = writes.collect(request.name, request.wait_s)
            if isinstance(entry, int):  # still writing: the bytes written so far
                return _send(sink, msg.CheckpointReply(index=self.shard.index, pending=True, written=entry))
        elif request.background:
            holds = writes.begin(request.name, self.shard, parent=request.parent)
            return _send(sink, msg.CheckpointReply(index=self.shard.index, pending=True, holds_changes=holds))
        else:
            entry = writes(request.name, self.shard, parent=request.parent)
        return _send(sink, msg.CheckpointReply(**entry))

    def assign(self, request: msg.AssignRequest, tensors: dict, sink: Sink) -> Any:
        return _send(sink, msg.AssignReply(version=self.shard.assign(tensors)))

    def shutdown(self, request: msg.ShutdownRequest, tensors: dict, sink: Sink) -> Any:
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
        return _send(sink, msg.ShutdownReply(version=version))

    def prove(self, request: msg.ProveRequest, tensors: dict, sink: Sink) -> Any:
        if self.run_secret is None:
            raise FailedPreconditionError(f"shard {self.shard.index} holds no run secret (no `paramserver run`)")
        return _send(sink, msg.ProveReply(proof=self.run_secret.prove(ps_node(self.shard.index), request.nonce)))

    def leave(self, request: msg.LeaveRequest, tensors: dict, sink: Sink) -> Any:
        if request.gone is None:
            self.shard.leave(request.worker, request.barrier)
        else:
            self.shard.forget(request.worker, request.gone)
        return _send(sink, msg.LeaveReply(version=self.shard.version, step=self.shard.sync_step))

    def set_mode(self, request: msg.SetModeRequest, tensors: dict, sink: Sink) -> Any:
        self.shard.set_mode(ConsistencySpec.from_dict(request.consistency))
        return _send(sink, msg.SetModeReply(version=self.shard.version, step=self.shard.sync_step))


def _send(sink: Sink, reply: msg.Message, tensors: list | tuple = ()) -> Any:
    return sink(codec.encode_parts(reply.to_meta(), tensors))


def _tensor(tensors: dict[str, np.ndarray], name: str, field: str) -> np.ndarray:
    """The tensor `name` of request field `field`; one the frame lacks is MALFORMED."""
    if name not in tensors:
        raise MalformedFrameError(f"request field {field!r} names tensor {name!r}, which the frame lacks")
    return tensors[name]


def _gradients(tensors: dict[str, np.ndarray], request: msg.PushPullRequest) -> dict[str, np.ndarray]:
    """A step's dense gradients: the tensors that neither `rows` nor `lookups` names, by part name.
    A tensor named twice is MALFORMED."""
    named = [*(name for push in request.rows for name in (push.ids, push.grads)), *(x.ids for x in request.lookups)]
    riders = set(named)
    if len(riders) != len(named):
        raise MalformedFrameError("a PushPull request names one tensor in two places")
    return {name: tensor for name, tensor in tensors.items() if name not in riders}
