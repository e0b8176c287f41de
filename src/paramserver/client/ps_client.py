"""The client that talks to every shard of the cluster.

One request per shard per operation carries all of that shard's parts; requests to
different shards are in flight at the same time. Every call has a deadline.

Thread-safety: `register` must not run concurrently with anything else; `push_pull`
may be called from one thread at a time per client (one training loop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..base.compression_spec import Codec
from ..base.consistency_spec import ConsistencySpec
from ..base.errors import InvalidArgumentError, ParamServerError
from ..transport.channel import CallHandle, ShardChannel
from ..wire import codec
from ..wire import messages as msg
from .compression import GradientCompressor
from .placement import DEFAULT_SPLIT_BYTES, Part, Placer
from .table_client import StepRiders

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 5.0  # a peer that does not answer Hello within this counts as down (it is restarting)


@dataclass
class PushPullHandle:
    """Replies of one push/pull across shards. `wait(timeout)` returns {var: [(part, values)]}."""

    calls: list[tuple[int, CallHandle]]
    parts: dict[str, Part]
    on_reply: Callable[[dict[int, dict]], None] | None = None
    riders: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # filled by wait: "~" tensors by shard

    def wait_sent(self, timeout: float) -> None:
        """Return once every request was copied out: the pushed arrays may then change."""
        deadline = time.monotonic() + timeout
        for _, call in self.calls:
            call.wait_sent(max(0.0, deadline - time.monotonic()))

    def wait(self, timeout: float) -> tuple[dict[int, dict], list[tuple[Part, np.ndarray]]]:
        """Block until every shard replied; returns ({shard: reply meta}, [(part, values)]).

        The values may view transport buffers: consume them before the next call on this client.
        """
        deadline = time.monotonic() + timeout
        metas, values = {}, []
        for shard, call in self.calls:
            frame = codec.decode(call.wait(max(0.0, deadline - time.monotonic())))
            metas[shard] = frame.meta
            for name, array in frame.tensors.items():
                if name.startswith("~"):
                    self.riders.setdefault(shard, {})[name] = array
                else:
                    values.append((self.parts[name], array))
        if self.on_reply is not None:
            self.on_reply(metas)
        return metas, values


@dataclass
class PushRecord:
    """What the shards said of this client's pushes: the sync step and staleness."""

    step: int = 0  # the sync step the next push belongs to
    staleness: int = 0  # of the latest push, the largest over shards
    staleness_sum: int = 0
    pushes: int = 0
    dropped: int = 0  # pushes a shard dropped as late (sync with backup workers)
    restored: int = 0  # the step of the checkpoint the shards started from (0: none)
    position: int = 0  # steps this worker trained as the shards saw them (a restarted worker goes on there)
    base_versions: dict[int, int] = field(default_factory=dict)

    def note_registered(self, metas: dict[int, dict]) -> None:
        """Register replies (RegisterReply metas, by shard)."""
        for shard, meta in metas.items():
            reply = msg.RegisterReply.from_meta(meta)
            self.base_versions[shard] = reply.version
            self.restored = max(self.restored, reply.restored)
            self.position = max(self.position, reply.position)

    def note(self, metas: dict[int, dict], pushed: bool) -> None:
        """PushPull replies (PushPullReply metas, by shard)."""
        replies = [msg.PushPullReply.from_meta(meta) for meta in metas.values()]
        for shard, reply in zip(metas, replies):
            self.base_versions[shard] = reply.version
        if replies:
            self.step = max(reply.step for reply in replies)
        if pushed:
            # staleness of what was applied; a push dropped as late is counted apart
            self.staleness = max((reply.staleness for reply in replies if reply.applied), default=0)
            self.staleness_sum += self.staleness
            self.pushes += 1
            self.dropped += any(not reply.applied for reply in replies)


class PSClient:
    """Registers variables on the shards, pushes gradients and pulls values, as worker `worker`."""

    def __init__(
        self,
        channels: list[ShardChannel],
        rpc_timeout_s: float,
        split_bytes: int = DEFAULT_SPLIT_BYTES,
        worker: int = 0,
        consistency: ConsistencySpec | None = None,
    ) -> None:
        self.channels = channels
        self.worker = worker
        self.consistency = consistency or ConsistencySpec()
        self.record = PushRecord()
        self.resumed_from: str | None = None  # the barrier this worker last left the quorums for
        self._owed_resumed: set[int] = set()  # shards not yet told (with a push) that it opened
        self.rpc_timeout_s = rpc_timeout_s
        self.placer = Placer(len(channels), split_bytes)
        self.parts_of: dict[str, list[Part]] = {}
        self._part_by_name: dict[str, Part] = {}
        self._groups_on: dict[int, set[str]] = {}
        self.compressor = GradientCompressor()  # codecs by variable (register), their residuals
        self.pushed_bytes = 0  # PushPull requests that pushed something, whole frames

    @property
    def gradient_bytes(self) -> int:
        """Bytes of every gradient pushed (dense and rows), as encoded."""
        return self.compressor.gradient_bytes

    @property
    def num_shards(self) -> int:
        return len(self.channels)

    def connect(self, timeout: float) -> None:
        """Wait until every shard answered Hello (which also checks the protocol version)."""
        deadline = time.monotonic() + timeout
        for channel in self.channels:
            channel.wait_ready(max(0.1, deadline - time.monotonic()))

    @property
    def incarnations(self) -> list[str | None]:
        """Each shard's process as `connect` found it (None: a channel that does not say, e.g. in-process)."""
        return [(getattr(channel, "hello", None) or {}).get("incarnation") for channel in self.channels]

    def register(
        self,
        group: str,
        optimizer_spec: dict,
        values: dict[str, np.ndarray],
        wire: dict[str, str] | None = None,
        codecs: dict[str, Codec] | None = None,
    ):
        """Place and register a group of variables (float32 values); returns the handle of the shards'
        current values. `wire`: the variables whose gradients and values travel as bfloat16 or float16
        (wire/half.py), by name; their pushed gradients and pulled values are in that dtype.
        `codecs`: how each float32 variable's gradients are compressed (absent: sent as they are)."""
        by_shard: dict[int, list[tuple[str, np.ndarray]]] = {}
        dtypes: dict[int, dict[str, str]] = {}
        for var, array in values.items():
            if var in self.parts_of:
                raise InvalidArgumentError(f"variable {var!r} is already registered")
            parts = self.placer.place(var, tuple(array.shape), array.dtype.itemsize)
            self.parts_of[var] = parts
            for part in parts:
                self._part_by_name[part.name] = part
                by_shard.setdefault(part.shard, []).append((part.name, _rows(array, part)))
                if (wire or {}).get(var, "float32") != "float32":
                    dtypes.setdefault(part.shard, {})[part.name] = wire[var]
        for var, var_codec in (codecs or {}).items():
            self.compressor.add(var, var_codec, tuple(values[var].shape))
        for shard in by_shard:
            self._groups_on.setdefault(shard, set()).add(group)
        calls = []
        for shard, tensors in sorted(by_shard.items()):
            meta = msg.RegisterRequest(
                group=group,
                optimizer=optimizer_spec,
                consistency=self.consistency.to_dict(),
                worker=self.worker,
                dtypes=dtypes.get(shard, {}),
            ).to_meta()
            calls.append(
                (shard, self.channels[shard].call("Register", codec.encode_parts(meta, tensors), self.rpc_timeout_s))
            )
        return PushPullHandle(calls, self._part_by_name, self.record.note_registered)

    def push_pull(
        self,
        grads: dict[str, np.ndarray],
        pull: list[str],
        lrs: dict[str, float] | None = None,
        base_versions: dict[int, int] | None = None,
        owned: bool = False,
        riders: StepRiders | None = None,
    ) -> PushPullHandle:
        """Push `grads` (by variable) and pull the variables in `pull`, one request per shard involved.

        `base_versions` are the shard versions the gradients were computed from (default: the
        latest replies'), for the shards to measure staleness. `owned` replies stay valid while
        other calls go out (for a handle waited on later). `riders`: embedding-row pushes and
        lookups sent in the same requests (their rows come back in the handle's `riders`).
        """
        bases = self.record.base_versions if base_versions is None else base_versions
        pushed: dict[int, list[tuple[str, np.ndarray]]] = {}
        headers: dict[int, dict[str, dict]] = {}  # by shard: the compressed gradients' encodings
        for var, grad in grads.items():
            for part in self.parts_of[var]:
                rows = None if part.whole else slice(part.lo, part.hi)
                header, tensors = self.compressor.encode(var, part.name, _rows(grad, part), rows)
                pushed.setdefault(part.shard, []).extend(tensors)
                if header is not None:
                    headers.setdefault(part.shard, {})[part.name] = header
        pulled: dict[int, list[str]] = {}
        for var in pull:
            for part in self.parts_of[var]:
                pulled.setdefault(part.shard, []).append(part.name)
        calls = []
        row_pushes, lookups, ride_tensors = (
            (riders.row_pushes, riders.lookups, riders.tensors) if riders is not None else ({}, {}, {})
        )
        for shard, encodings in riders.codecs.items() if riders is not None else ():
            headers.setdefault(shard, {}).update(encodings)
        # with embedding tables every shard hears of every step (a marker where there is nothing
        # else for it), so that a sync step on a shard holding only rows does not wait for this worker
        shards = range(self.num_shards) if riders is not None else set(pushed) | set(pulled)
        for shard in sorted(shards):
            shard_lrs = {g: lr for g, lr in (lrs or {}).items() if g in self._groups_on.get(shard, ())}
            resumed = None
            if shard in self._owed_resumed and (shard in pushed or riders is not None):
                resumed = self.resumed_from
                self._owed_resumed.discard(shard)
            request = msg.PushPullRequest(
                pull=pulled.get(shard, []),
                worker=self.worker,
                step=self.record.step,
                sparse=row_pushes.get(shard, []),
                lookup=lookups.get(shard, []),
                resumed=resumed,
                marker=riders is not None and shard not in pushed and shard not in row_pushes,
                base=bases.get(shard),
                lr=shard_lrs,
                codecs=headers.get(shard, {}),
            )
            payload = codec.encode_parts(request.to_meta(), [*pushed.get(shard, ()), *ride_tensors.get(shard, ())])
            if shard in pushed or shard in row_pushes:
                self.pushed_bytes += codec.parts_size(payload)
            calls.append((shard, self.channels[shard].call("PushPull", payload, self.rpc_timeout_s, owned)))
        return PushPullHandle(calls, self._part_by_name, lambda metas: self.record.note(metas, bool(grads)))

    def assign(self, values: dict[str, np.ndarray], timeout: float) -> None:
        """Overwrite registered variables' values on their shards (see Shard.assign); each shard checks
        all of its parts before it writes any. Call while no push of this worker is in flight."""
        by_shard: dict[int, list[tuple[str, np.ndarray]]] = {}
        for var, array in values.items():
            for part in self.parts_of[var]:
                by_shard.setdefault(part.shard, []).append((part.name, _rows(array, part)))
        payload = msg.AssignRequest(worker=self.worker).to_meta()
        calls = [
            self.channels[shard].call("Assign", codec.encode_parts(payload, parts), timeout)
            for shard, parts in sorted(by_shard.items())
        ]
        for call in calls:
            call.wait(timeout)

    def set_mode(self, spec: ConsistencySpec) -> None:
        """Switch every shard to `spec` now (see Shard.set_mode)."""
        payload = codec.encode(msg.SetModeRequest(consistency=spec.to_dict()).to_meta())
        for call in [channel.call("SetMode", payload, self.rpc_timeout_s) for channel in self.channels]:
            call.wait(self.rpc_timeout_s)
        self.consistency = spec

    def leave(self, timeout: float, barrier: str | None = None) -> None:
        """Tell every shard this worker finished its data, or waits at `barrier`, so that steps stop
        waiting for it (its next push brings it back). Best effort. After `barrier` opened, the
        next push says so (`resumed_from`): every worker that waited there is back at once."""
        self._tell_all(msg.LeaveRequest(worker=self.worker, barrier=barrier or None), timeout)
        self.resumed_from = barrier
        self._owed_resumed = set(range(self.num_shards)) if barrier else set()

    def forget(self, worker: int, why: str, timeout: float) -> None:
        """Tell every shard that `worker` is gone for good (`why`): waits that need it fail at once."""
        self._tell_all(msg.LeaveRequest(worker=worker, gone=why), timeout)

    def _tell_all(self, request: msg.LeaveRequest, timeout: float) -> None:
        payload = codec.encode(request.to_meta())
        calls = [channel.call("Leave", payload, timeout) for channel in self.channels]
        for call in calls:
            try:
                call.wait(timeout)
            except ParamServerError as exc:
                log.warning("leave %s: %s", request.to_meta(), exc)

    def checkpoint(self, name: str, timeout: float) -> list[dict]:
        """Have every shard write its file of checkpoint `name` under its own checkpoint directory,
        all at once; returns their manifest entries. Call while no push is in flight."""
        payload = codec.encode(msg.CheckpointRequest(name=name).to_meta())
        calls = [channel.call("Checkpoint", payload, timeout) for channel in self.channels]
        deadline = time.monotonic() + timeout
        entries, errors = [], []
        for call in calls:  # every shard answers before a failure is raised: none still writes after
            try:
                reply = call.wait(max(0.0, deadline - time.monotonic()))
                entries.append(msg.CheckpointReply.from_meta(codec.decode(reply).meta).to_meta())
            except ParamServerError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return entries

    def shard_stats(self) -> list[dict]:
        """Each shard's counters (version, sync step, mode, pushes, late drops, staleness)."""
        payload = codec.encode(msg.HelloRequest().to_meta())
        calls = [channel.call("Hello", payload, self.rpc_timeout_s) for channel in self.channels]
        return [msg.HelloReply.from_meta(codec.decode(call.wait(self.rpc_timeout_s)).meta).to_meta() for call in calls]

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def _rows(array: np.ndarray, part: Part) -> np.ndarray:
    return array if part.whole else array[part.lo : part.hi]


def hello(channel, timeout: float = HELLO_TIMEOUT_S) -> dict:
    """A PS's Hello reply (its counters, incarnation and groups)."""
    payload = codec.encode(msg.HelloRequest().to_meta())
    return codec.decode(channel.call("Hello", payload, timeout).wait(timeout)).meta
