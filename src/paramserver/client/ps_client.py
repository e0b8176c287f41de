"""The client that talks to every shard of the cluster.

One request per shard per operation carries all of that shard's parts; requests to
different shards are in flight at the same time. Every call has a deadline.

Thread-safety: `register` must not run concurrently with anything else; `push_pull`
may be called from one thread at a time per client (one training loop).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paramserver.base.compression_spec import Codec
from paramserver.base.consistency_spec import ConsistencySpec
from paramserver.base.deadline import Deadline
from paramserver.base.errors import InvalidArgumentError, ParamServerError, RollbackError, UnavailableError
from paramserver.client import checkpoint_write
from paramserver.client.checkpoint_write import CheckpointWrite
from paramserver.client.compression import GradientCompressor
from paramserver.client.link import AutoCompression, measure
from paramserver.client.placement import DEFAULT_SPLIT_BYTES, Part, Placer
from paramserver.client.table_client import NO_ROWS, StepRiders
from paramserver.transport.channel import ShardChannel
from paramserver.transport.stream import host_id
from paramserver.wire import messages as msg
from paramserver.wire.calls import Pending, gather
from paramserver.wire.stubs import ShardStub

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 5.0  # a peer that does not answer Hello within this counts as down (it is restarting)


@dataclass
class PushPullHandle:
    """Replies of one push/pull (or register) across shards. `wait(timeout)` returns
    ({shard: reply}, [(part, values)]); a step's looked-up rows land in `riders` by shard."""

    calls: list[tuple[int, Pending[Any]]]
    parts: dict[str, Part]
    on_reply: Callable[[dict[int, Any]], None] | None = None
    riders: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # filled by wait: rows by name, by shard
    # partial recovery: a shard that is gone (unreachable, or a new process) lands in `failed` instead of raising
    tolerate_lost: bool = False
    failed: dict[int, ParamServerError] = field(default_factory=dict)

    def wait_sent(self, timeout: float) -> None:
        """Return once every request was copied out: the pushed arrays may then change."""
        deadline = Deadline(timeout)
        for _, call in self.calls:
            call.wait_sent(deadline.left())

    def wait(self, timeout: float) -> tuple[dict[int, Any], list[tuple[Part, np.ndarray]]]:
        """Block until every shard replied; returns ({shard: reply message}, [(part, values)]).

        The values may view transport buffers: consume them before the next call on this client.
        """
        deadline = Deadline(timeout)
        replies, values = {}, []
        for shard, call in self.calls:
            try:
                replies[shard], tensors = call.wait(deadline.left())
            except (UnavailableError, RollbackError) as exc:
                if not self.tolerate_lost:
                    raise
                self.failed[shard] = exc  # the other shards' replies are still read
                continue
            for name, array in tensors.items():
                part = self.parts.get(name)
                if part is None:
                    self.riders.setdefault(shard, {})[name] = array
                else:
                    values.append((part, array))
        if self.on_reply is not None:
            self.on_reply(replies)
        return replies, values


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

    def note_registered(self, replies: dict[int, msg.RegisterReply]) -> None:
        """Register replies, by shard."""
        for shard, reply in replies.items():
            self.base_versions[shard] = reply.version
        self.note_position(replies.values())

    def note_position(self, replies: Iterable[msg.RegisterReply | msg.RegisterTableReply]) -> None:
        """This worker's data position and restored step from Register or RegisterTable replies: one
        position whether the model holds dense variables, tables or both."""
        for reply in replies:
            self.restored = max(self.restored, reply.restored)
            self.position = max(self.position, reply.position)

    def note(self, replies: dict[int, msg.PushPullReply], pushed: bool) -> None:
        """PushPull replies, by shard."""
        for shard, reply in replies.items():
            self.base_versions[shard] = reply.version
        if replies:
            self.step = max(reply.step for reply in replies.values())
        if pushed:
            # staleness of what was applied; a push dropped as late is counted apart
            applied = [reply.staleness for reply in replies.values() if reply.applied]
            self.staleness = max(applied, default=0)
            self.staleness_sum += self.staleness
            self.pushes += 1
            self.dropped += any(not reply.applied for reply in replies.values())


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
        self.channels = channels  # and a typed stub over each (the setter)
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
        # "bfloat16" / "float16": PushPull replies bring float32 variables' values at half width (None: as they are)
        self.pull_as: str | None = None
        self.auto: AutoCompression | None = None  # compression "auto" (client/link.py): see enable_auto
        self._pull_as_set: str | None = None
        self._plain: dict[str, tuple[int, ...]] = {}  # float32 variables sent as they are: what auto may compress
        self.pushed_bytes = 0  # PushPull requests that pushed something, whole frames
        self.tolerate_lost = False  # partial recovery: a lost shard's calls fail in the handle, not in wait()
        # by shard: each registration sent to it, in order (a shard restored alone is registered with again)
        self._registrations: dict[int, list[tuple[msg.RegisterRequest, list]]] = {}

    @property
    def channels(self) -> list[ShardChannel]:
        return self._channels

    @channels.setter
    def channels(self, channels: list[ShardChannel]) -> None:
        self._channels = list(channels)
        self.stubs = [ShardStub(channel) for channel in self._channels]

    @property
    def gradient_bytes(self) -> int:
        """Bytes of every gradient pushed (dense and rows), as encoded."""
        return self.compressor.gradient_bytes

    @property
    def num_shards(self) -> int:
        return len(self.channels)

    def connect(self, timeout: float) -> None:
        """Wait until every shard answered Hello (which also checks the protocol version)."""
        deadline = Deadline(timeout)
        for channel in self.channels:
            channel.wait_ready(max(0.1, deadline.left()))

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
                dtype = (wire or {}).get(var, "float32")
                if dtype != "float32":
                    dtypes.setdefault(part.shard, {})[part.name] = dtype
        for var, var_codec in (codecs or {}).items():
            self.compressor.add(var, var_codec, tuple(values[var].shape))
        for var, array in values.items():
            if (wire or {}).get(var, "float32") == "float32" and var not in self.compressor.codecs:
                self._plain[var] = tuple(array.shape)
        for shard in by_shard:
            self._groups_on.setdefault(shard, set()).add(group)
        calls = []
        for shard, tensors in sorted(by_shard.items()):
            request = msg.RegisterRequest(
                group=group,
                optimizer=optimizer_spec,
                consistency=self.consistency.to_dict(),
                worker=self.worker,
                dtypes=dtypes.get(shard, {}),
            )
            calls.append((shard, self.stubs[shard].register(request, self.rpc_timeout_s, tensors)))
            self._registrations.setdefault(shard, []).append((request, tensors))
        return PushPullHandle(calls, self._part_by_name, self.record.note_registered)

    def replace_channel(self, shard: int, channel: ShardChannel) -> None:
        """Talk to `shard` through `channel` from now on (its process restarted); the old one is closed."""
        old = self._channels[shard]
        self._channels[shard] = channel
        self.stubs[shard] = ShardStub(channel)
        old.close()

    def register_again(self, shard: int, timeout: float, write: Callable[[list], None]) -> int:
        """Send `shard` every registration it was sent (a new process restored its state from a
        checkpoint: it keeps the restored values and opens this worker's session), one at a time,
        `write` given each reply's values; returns this worker's position as the shard counts it."""
        position = 0
        for request, tensors in self._registrations.get(shard, []):
            handle = PushPullHandle(
                [(shard, self.stubs[shard].register(request, timeout, tensors))], self._part_by_name
            )
            replies, values = handle.wait(timeout)
            write(values)
            self.record.base_versions[shard] = replies[shard].version
            position = max(position, replies[shard].position)
        return position

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
        if self.auto is not None and self.auto.watching and grads:
            plain = [var for var in grads if var in self._plain]
            self.auto.on_step(self._plain_bytes(plain), self._plain_bytes(pull), grads[plain[0]] if plain else None)
        pushed, headers = self._encoded(grads)
        pulled: dict[int, list[str]] = {}
        for var in pull:
            for part in self.parts_of[var]:
                pulled.setdefault(part.shard, []).append(part.name)
        calls = []
        # with embedding tables every shard hears of every step (a marker where there is nothing
        # else for it), so that a sync step on a shard holding only rows does not wait for this worker
        shards = range(self.num_shards) if riders is not None else set(pushed) | set(pulled)
        for shard in sorted(shards):
            rows = riders.on(shard) if riders is not None else NO_ROWS
            pushes = shard in pushed or bool(rows.pushes)
            resumed = None
            if shard in self._owed_resumed and (shard in pushed or riders is not None):
                resumed = self.resumed_from
                self._owed_resumed.discard(shard)
            request = msg.PushPullRequest(
                pull=pulled.get(shard, []),
                worker=self.worker,
                step=self.record.step,
                rows=rows.pushes,
                lookups=rows.lookups,
                resumed=resumed,
                marker=riders is not None and not pushes,
                base=bases.get(shard),
                lr={g: lr for g, lr in (lrs or {}).items() if g in self._groups_on.get(shard, ())},
                codecs={**headers.get(shard, {}), **rows.codecs},
                pull_as=self.pull_as if pulled.get(shard) else None,
            )
            tensors = [*pushed.get(shard, ()), *rows.tensors]
            call = self.stubs[shard].push_pull(request, self.rpc_timeout_s, tensors, owned)
            if pushes:
                self.pushed_bytes += call.size
            calls.append((shard, call))
        return PushPullHandle(
            calls,
            self._part_by_name,
            lambda replies: self.record.note(replies, bool(grads)),
            tolerate_lost=self.tolerate_lost,
        )

    def enable_auto(self, timeout: float) -> None:
        """Compression "auto" (client/link.py): PS on another host (their Hello's host id is not this
        host's) have their links measured at the first step and, after a window of steps, the float32
        variables sent as they are may be compressed for all of them. Call after `connect`."""
        here = host_id()
        hosts = [(getattr(channel, "hello", None) or {}).get("host_id") for channel in self.channels]
        remote = [shard for shard, host in enumerate(hosts) if host is not None and host != here]
        self._pull_as_set = self.pull_as  # the user's `pull_as` stays whatever auto chooses
        self.auto = AutoCompression(remote, lambda shard: measure(self.stubs[shard], timeout), self._apply_auto)

    def _apply_auto(self, codec: Codec, pull_as: str | None) -> None:
        for var, shape in self._plain.items():
            self.compressor.add(var, codec, shape)
        self.pull_as = self._pull_as_set or pull_as

    def _plain_bytes(self, names) -> dict[int, int]:
        """The float32 bytes of the plain variables among `names`, by shard."""
        found: dict[int, int] = {}
        for var in names:
            shape = self._plain.get(var)
            if shape is None:
                continue
            row_bytes = 4 * math.prod(shape[1:])  # a scalar is one row of 4 bytes
            for part in self.parts_of[var]:
                rows = part.hi - part.lo if not part.whole else (shape[0] if shape else 1)
                found[part.shard] = found.get(part.shard, 0) + row_bytes * rows
        return found

    def _encoded(
        self, grads: dict[str, np.ndarray]
    ) -> tuple[dict[int, list[tuple[str, np.ndarray]]], dict[int, dict[str, dict]]]:
        """(the tensors to push, by shard; the compressed gradients' encodings, by shard and part).
        A variable without a codec goes as it is, the compressor not called (only counting its bytes)."""
        compressor = self.compressor
        pushed: dict[int, list[tuple[str, np.ndarray]]] = {}
        headers: dict[int, dict[str, dict]] = {}
        for var, grad in grads.items():
            encoded = var in compressor.codecs  # absent: sent as is (GradientCompressor.codecs)
            for part in self.parts_of[var]:
                rows = _rows(grad, part)
                if not encoded:
                    compressor.gradient_bytes += rows.nbytes
                    pushed.setdefault(part.shard, []).append((part.name, rows))
                    continue
                span = None if part.whole else slice(part.lo, part.hi)
                header, tensors = compressor.encode(var, part.name, rows, span)
                pushed.setdefault(part.shard, []).extend(tensors)
                if header is not None:
                    headers.setdefault(part.shard, {})[part.name] = header
        return pushed, headers

    def assign(self, values: dict[str, np.ndarray], timeout: float) -> None:
        """Overwrite registered variables' values on their shards (see Shard.assign); each shard checks
        all of its parts before it writes any. Call while no push of this worker is in flight."""
        by_shard: dict[int, list[tuple[str, np.ndarray]]] = {}
        for var, array in values.items():
            for part in self.parts_of[var]:
                by_shard.setdefault(part.shard, []).append((part.name, _rows(array, part)))
        request = msg.AssignRequest(worker=self.worker)
        gather(
            [self.stubs[shard].assign(request, timeout, parts) for shard, parts in sorted(by_shard.items())], timeout
        )

    def set_mode(self, spec: ConsistencySpec) -> None:
        """Switch every shard to `spec` now (see Shard.set_mode)."""
        request = msg.SetModeRequest(consistency=spec.to_dict())
        gather([stub.set_mode(request, self.rpc_timeout_s) for stub in self.stubs], self.rpc_timeout_s)
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
        deadline = Deadline(timeout)
        for call in [stub.leave(request, timeout) for stub in self.stubs]:
            try:
                call.wait(deadline.left())
            except ParamServerError as exc:
                log.warning("leave %s: %s", request.to_meta(), exc)

    def end_shards(self, timeout: float) -> None:
        """Tell every shard the run completed: each drains and its process exits 0 (a Shutdown with
        `end`). Best effort: a shard that does not answer is logged."""
        request = msg.ShutdownRequest(reason="the run completed", end=True)
        deadline = Deadline(timeout)
        for index, call in enumerate([stub.shutdown(request, timeout) for stub in self.stubs]):
            try:
                call.wait(deadline.left())
            except ParamServerError as exc:
                log.warning("ps %d did not take the end of the run: %s", index, exc)

    def checkpoint(self, name: str, timeout: float, parent: str = "") -> list[dict]:
        """Have every shard write its file of checkpoint `name` under its own checkpoint directory,
        all at once (a delta on checkpoint `parent`, when given); returns their manifest entries.
        Call while no push is in flight."""
        request = msg.CheckpointRequest(name=name, parent=parent)
        calls = [stub.checkpoint(request, timeout) for stub in self.stubs]
        deadline = Deadline(timeout)
        entries, errors = [], []
        for call in calls:  # every shard answers before a failure is raised: none still writes after
            try:
                entries.append(call.wait(deadline.left())[0].to_meta())
            except ParamServerError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return entries

    def begin_checkpoint(self, name: str, timeout: float, parent: str = "") -> CheckpointWrite:
        """Have every shard take its cut of checkpoint `name` now and write its file in the background
        (client/checkpoint_write.py); `collect()` on the result waits for the files. Call while no push
        is in flight; pushes may go on once it returns."""
        return checkpoint_write.begin(lambda: self.stubs, name, timeout, parent)

    def shard_stats(self) -> list[dict]:
        """Each shard's counters (version, sync step, mode, pushes, late drops, staleness)."""
        calls = [stub.hello(msg.HelloRequest(), self.rpc_timeout_s) for stub in self.stubs]
        return [reply.to_meta() for reply, _ in gather(calls, self.rpc_timeout_s)]

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def _rows(array: np.ndarray, part: Part) -> np.ndarray:
    return array if part.whole else array[part.lo : part.hi]


def hello(channel, timeout: float = HELLO_TIMEOUT_S) -> dict:
    """A PS's Hello reply (its counters, incarnation and groups)."""
    return ShardStub(channel).hello(msg.HelloRequest(), timeout).wait(timeout)[0].to_meta()
