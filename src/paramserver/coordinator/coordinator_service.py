"""The coordinator over the wire: a thin service, and the worker's client with its heartbeat thread.

Methods of service ``paramserver.Coordinator`` (frames without tensors): Hello, Join, Heartbeat,
Finish, Barrier (a long poll: the reply says "open", or the workers still "waiting"), Leave,
RequestCheckpoint, Split (the next split of the data: coordinator/dispatcher.py) (each replies with
the view, CoordinatorReply), and Prove (no token needed: the
host answers a challenge with its run's secret, security/run_secret.py). Requests and replies are
the messages of wire/messages.py (COORDINATOR_METHODS), documented there and in docs/protocol.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from paramserver.base.deadline import Deadline
from paramserver.base.errors import DeadlineExceededError, FailedPreconditionError, ParamServerError, UnavailableError
from paramserver.base.lifecycle import Lifecycle, ReadyFlag
from paramserver.coordinator.membership import MAX_BARRIER_WAIT_S, Coordinator
from paramserver.security.auth import Claim, Guard
from paramserver.security.run_secret import COORDINATOR_NODE, RunSecret
from paramserver.wire import codec
from paramserver.wire import messages as msg
from paramserver.wire.calls import Request, decode_request
from paramserver.wire.stubs import CoordinatorStub

if TYPE_CHECKING:
    from paramserver.base.metrics import CallMetrics

log = logging.getLogger(__name__)
SERVICE = "paramserver.Coordinator"
_CONNECT_ATTEMPT_S = 1.0  # the joining thread's longest wait for the coordinator before it checks for stop()


class CoordinatorService:
    """Parses a request (wire/messages.py), calls the Coordinator, encodes its view. Thread-safe."""

    calls: CallMetrics  # set by a host that records its calls (transport/dispatch.py reads it when present)

    def __init__(self, coordinator: Coordinator, run_secret: RunSecret | None = None) -> None:
        """`run_secret`: the secret of the run that started the host (Prove), if one did."""
        self.coordinator = coordinator
        self.run_secret = run_secret
        self.methods: dict[str, Callable[[Any], dict]] = {
            "Hello": lambda request: coordinator.hello(),
            "Join": lambda request: coordinator.join(request.worker),
            "Heartbeat": lambda request: coordinator.heartbeat(
                request.worker, request.step, request.wait, request.checkpoints, request.position
            ),
            "Finish": lambda request: coordinator.finish(request.worker),
            "Barrier": lambda request: coordinator.barrier(
                request.name, request.worker, request.wait, request.training_only, request.position
            ),
            "Leave": lambda request: coordinator.leave(request.worker, request.position),
            "RequestCheckpoint": lambda request: coordinator.request_checkpoint(request.worker),
            "Split": lambda request: coordinator.split(
                request.worker, request.splits, request.epochs, request.done, request.wait
            ),
            "Prove": self._prove,
        }
        self.guard: Guard | None = None  # tokens, roles and audit (transport/dispatch.py), given by the host

    def decode(self, method: str, payload: Any) -> Request:
        """The request frame, decoded once (NOT_FOUND for an unknown method, MALFORMED naming a bad field)."""
        return decode_request("coordinator", msg.COORDINATOR_METHODS, method, payload)

    def claim(self, request: Request) -> Claim:
        """What a request asks for and as which worker (checked against the caller's role before `serve`)."""
        return Claim(request.method, getattr(request.message, "worker", None))

    def serve(self, request: Request, sink: Callable[[list], Any] = b"".join) -> Any:
        view = self.methods[request.method](request.message)
        _, reply = msg.COORDINATOR_METHODS[request.method]
        return sink(codec.encode_parts(reply(**view).to_meta()))

    def caller_gone(self, method: str, payload: Any) -> None:
        """The transport saw a worker's heartbeat cancelled before its deadline (its process died, so its
        connection closed): an elastic run drops it now rather than after the heartbeat timeout."""
        if method != "Heartbeat":
            return
        try:
            worker = self.decode(method, payload).message.worker
        except ParamServerError:
            return
        self.coordinator.caller_gone(worker)

    def _prove(self, request: msg.ProveRequest) -> dict:
        if self.run_secret is None:
            raise FailedPreconditionError("the coordinator holds no run secret: no `paramserver run` started it")
        return {"proof": self.run_secret.prove(COORDINATOR_NODE, request.nonce)}

    def call(self, method: str, payload: Any, sink: Callable[[list], Any] = b"".join) -> Any:
        """Decode and serve one request frame (what dispatch does, less the guard)."""
        return self.serve(self.decode(method, payload), sink)


class CoordinatorClient(Lifecycle):
    """A worker's membership: joins, heartbeats on a named thread, barriers, leaves.

    Lifecycle (base/lifecycle.py): `start()` starts the thread "heartbeat-worker<N>", which joins
    (trying to reach the coordinator until it answers or `stop`) and then beats every
    `heartbeat_s`; `wait_ready(timeout)` blocks until this worker joined; `stop(grace)` leaves
    (if it joined), closes the channel and joins the thread, within about `grace` seconds. `step`
    is read by the heartbeat thread; the training thread sets it.
    """

    def __init__(
        self,
        channel,
        worker: int,
        rpc_timeout_s: float,
        heartbeat_s: float = 1.0,
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        """`on_restart(reason)`: called (from the thread whose call saw it) when a reply comes from a
        coordinator other than the one this worker joined: the chief restarted."""
        self.channel = channel
        self.stub = CoordinatorStub(channel)
        self.on_restart = on_restart
        self.incarnation: str | None = None  # the coordinator's this worker joined
        self.worker = worker
        self.rpc_timeout_s = rpc_timeout_s
        self.heartbeat_s = heartbeat_s
        self.poll_s = 5.0  # longest wait of one Barrier call
        self.step = 0
        # the data split this worker trains and the batches of it trained, (epoch, split, position), set by the
        # training thread (worker/dispatched.py) and sent with heartbeats, barriers and the leave
        self.position: tuple[int, int, int] | None = None
        self.split_lost = False  # a reply said the split reported on was taken back (the worker was found dead)
        self.view: dict = {}
        self.ready = ReadyFlag(f"worker {worker}'s join to the coordinator at {getattr(channel, 'address', '?')}")
        self._stopping = threading.Event()
        self._stop_lock = threading.Lock()
        self._joined = False
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-worker{worker}", daemon=True)

    def _call(self, method: str, deadline_s: float | None = None, **fields: Any) -> dict:
        timeout = deadline_s or self.rpc_timeout_s
        request_type, _ = msg.COORDINATOR_METHODS[method]
        assert issubclass(request_type, msg.JoinRequest), method  # every method called here names its worker
        reply, _ = self.stub.call(method, request_type(worker=self.worker, **fields), timeout).wait(timeout)
        self.view = reply.to_meta()
        if reply.split_lost and _same_split(fields.get("position"), self.position):
            self.split_lost = True
        incarnation = self.view.get("incarnation")
        if method == "Join" and self.incarnation is None:
            self.incarnation = incarnation
        elif incarnation != self.incarnation and self.on_restart is not None:
            self.on_restart(
                f"the coordinator restarted (the chief; incarnation {self.incarnation} is now {incarnation})"
            )
        return self.view

    def restarted(self) -> str | None:
        """Why the coordinator is not the one this worker joined (it restarted, or does not answer), or None."""
        timeout = min(self.rpc_timeout_s, 5.0)
        try:
            now = self.stub.hello(msg.CoordinatorHelloRequest(), timeout).wait(timeout)[0].incarnation
        except ParamServerError as exc:
            return f"the coordinator does not answer ({exc})"
        if now != self.incarnation:
            return f"the coordinator restarted (incarnation {self.incarnation} is now {now})"
        return None

    def published(self, key: str, timeout: float, poll_s: float = 0.05) -> str:
        """What the hosting worker published under `key`, waiting at most `timeout` seconds for it
        (UnavailableError after that)."""
        deadline = Deadline(timeout)
        while True:
            call_timeout = max(0.1, min(self.rpc_timeout_s, deadline.left()))
            view, _ = self.stub.hello(msg.CoordinatorHelloRequest(), call_timeout).wait(call_timeout)
            value = (view.published or {}).get(key)
            if value is not None:
                return value
            if deadline.passed():
                raise UnavailableError(f"the coordinator published no {key!r} within {timeout:.0f}s")
            time.sleep(poll_s)

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float) -> None:
        """Block until this worker joined (UnavailableError, with the last connection error, if it did
        not within `timeout`; the thread keeps trying until `stop`)."""
        self.ready.wait(timeout)

    def _run(self) -> None:
        try:
            self._join()
        except Exception as exc:  # handed to wait_ready
            self.ready.fail(exc)
            return
        self.ready.set()
        self._beat()

    def _join(self) -> None:
        while True:
            if self._stopping.is_set():
                raise UnavailableError(f"worker {self.worker} stopped before it joined the coordinator")
            try:
                self.channel.wait_ready(_CONNECT_ATTEMPT_S)
                break
            except UnavailableError as exc:  # not up yet: try again
                self.ready.detail = str(exc)
                self._stopping.wait(0.05)  # a refused connection fails at once: no busy loop
        self._call("Join")
        self._joined = True

    def barrier(
        self,
        name: str,
        timeout: float | None = None,
        training_only: bool = False,
        between: Callable[[], object] | None = None,
    ) -> dict:
        """Wait until every worker that has not exited (with `training_only`: nor finished its data)
        reached barrier `name`: as long as they are alive (polls of `poll_s`), or at most `timeout`
        seconds when given. Fails at once with UnavailableError when one it needs is dead, and with
        FailedPreconditionError, naming who waits where, when the coordinator finds it can never
        open. `between()` runs after each poll that found it closed (e.g. to meet the others for a
        checkpoint announced meanwhile: a poll ends early when one is)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = self.poll_s if deadline is None else max(0.0, min(self.poll_s, deadline - time.monotonic()))
            view = self._call(
                "Barrier",
                wait + self.rpc_timeout_s,
                name=name,
                wait=wait,
                training_only=training_only,
                position=self.position,
            )
            if view.get("open"):
                return view
            if between is not None:
                between()
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(
                    f"barrier {name!r}: workers {view.get('waiting')} did not arrive in {timeout:.0f}s"
                )

    def finish(self) -> dict:
        """Tell the coordinator this worker's data is done."""
        return self._call("Finish")

    def resume(self) -> dict:
        """Tell the coordinator this worker trains again after `finish` (it joins again)."""
        return self._call("Join")

    def split(self, num_splits: int, epochs: int, done: tuple[int, int, int] | None, wait: float) -> dict:
        """The next split of the data for this worker, after `done` (coordinator/dispatcher.py): the view
        with `split` [epoch, split, position], or none and `data_done`. Holds at most `wait` seconds."""
        return self._call("Split", wait + self.rpc_timeout_s, splits=num_splits, epochs=epochs, done=done, wait=wait)

    def request_checkpoint(self) -> dict:
        """Ask the coordinator for a checkpoint (the chief's step count or clock): the reply names the
        one every worker meets for, after its current step (a new one, or one under way)."""
        return self._call("RequestCheckpoint")

    def _beat(self) -> None:
        """Heartbeats as long polls: each is held by the coordinator for up to `heartbeat_s`, and
        answered at once when a checkpoint is announced, so the workers meet for it within a step
        (a coordinator before 2.2 answers at once: the rest of the period is slept)."""
        while not self._stopping.is_set():
            started = time.monotonic()
            known = int(self.view.get("checkpoints_requested", 0))
            try:
                view = self._call(
                    "Heartbeat",
                    self.heartbeat_s + self.rpc_timeout_s,
                    step=self.step,
                    wait=min(self.heartbeat_s, MAX_BARRIER_WAIT_S),
                    checkpoints=known,
                    position=self.position,
                )
            except Exception as exc:
                if self._stopping.is_set():  # a call cut off by stop(), or on the channel it closed: no news
                    return
                if not isinstance(exc, ParamServerError):
                    raise
                log.warning("heartbeat to the coordinator failed: %s", exc)
                view = {}
            if int(view.get("checkpoints_requested", 0)) <= known:
                self._stopping.wait(max(0.0, self.heartbeat_s - (time.monotonic() - started)))

    def stop(self, grace: float = 5.0, leave: bool = True) -> None:
        """Leave (at most `grace` seconds), close the channel (a heartbeat in flight ends with it) and
        join the heartbeat thread. Idempotent; any thread.

        `leave=False` for a worker that exits to be restarted (a roll-back): it stays a member the
        others wait for, so that a chief done with its data keeps the coordinator up until the restart
        joins again (or the heartbeat timeout finds it dead)."""
        with self._stop_lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
        self.ready.fail(UnavailableError(f"worker {self.worker} stopped before it joined the coordinator"))
        started = time.monotonic()
        if self._joined and leave:
            try:
                self._call("Leave", deadline_s=max(0.1, grace), position=self.position)
            except ParamServerError as exc:
                log.info("leaving the coordinator: %s", exc)
        self.channel.close()
        if self._thread.ident is not None:  # started
            self._thread.join(max(0.1, grace - (time.monotonic() - started)) + _CONNECT_ATTEMPT_S)


def _same_split(sent: Any, now: tuple[int, int, int] | None) -> bool:
    """Whether the position a call reported names the split this worker trains now: a late reply about
    a split it finished or gave up already must not make it give up the next one."""
    return sent is not None and now is not None and (sent[0], sent[1]) == (now[0], now[1])
