"""The coordinator over the wire: a thin service, and the worker's client with its heartbeat thread.

Methods of service ``paramserver.Coordinator`` (frames without tensors; replies carry
{"global_step", "live", "workers", "states", "checkpoints_requested"}): ``Hello`` {},
``Join`` {"worker"}, ``Heartbeat`` {"worker", "step"}, ``Finish`` {"worker"} (its data is done),
``Barrier`` {"worker", "name", "wait", "training_only"?} (a long poll: the reply says "open", or
the workers still "waiting"), ``Leave`` {"worker"}, ``RequestCheckpoint`` {"worker"}.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ..base.errors import DeadlineExceededError, MalformedFrameError, ParamServerError
from ..transport import codec
from .membership import Coordinator

log = logging.getLogger(__name__)
SERVICE = "paramserver.Coordinator"


class CoordinatorService:
    """Decodes a request, calls the Coordinator, encodes its view. Thread-safe."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.methods: dict[str, Callable[[dict], dict]] = {
            "Hello": lambda meta: coordinator.view(),
            "Join": lambda meta: coordinator.join(_int(meta, "worker")),
            "Heartbeat": lambda meta: coordinator.heartbeat(_int(meta, "worker"), _int(meta, "step")),
            "Finish": lambda meta: coordinator.finish(_int(meta, "worker")),
            "Barrier": lambda meta: coordinator.barrier(_str(meta, "name"), _int(meta, "worker"),
                                                        _number(meta, "wait"), _bool(meta, "training_only")),
            "Leave": lambda meta: coordinator.leave(_int(meta, "worker")),
            "RequestCheckpoint": lambda meta: coordinator.request_checkpoint(_int(meta, "worker")),
        }

    def call(self, method: str, payload: bytes, sink: Callable[[list], Any] = b"".join) -> Any:
        handler = self.methods.get(method)
        if handler is None:
            raise MalformedFrameError(f"coordinator has no method {method!r}")
        return sink(codec.encode_parts(handler(codec.decode(payload).meta)))


def _int(meta: dict, key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedFrameError(f"coordinator request needs integer {key!r}, got {value!r}")
    return value


def _str(meta: dict, key: str) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or not value:
        raise MalformedFrameError(f"coordinator request needs a non-empty string {key!r}, got {value!r}")
    return value


def _bool(meta: dict, key: str) -> bool:
    value = meta.get(key, False)
    if not isinstance(value, bool):
        raise MalformedFrameError(f"coordinator request needs {key!r} as true or false, got {value!r}")
    return value


def _number(meta: dict, key: str) -> float:
    value = meta.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise MalformedFrameError(f"coordinator request needs a number {key!r}, got {value!r}")
    return float(value)


class CoordinatorClient:
    """A worker's membership: joins, heartbeats on a named thread, barriers, leaves.

    Lifecycle: `start()` (join + heartbeat thread), then `stop()` (leave). `step` is read by
    the heartbeat thread; the training thread sets it.
    """

    def __init__(self, channel, worker: int, rpc_timeout_s: float, heartbeat_s: float = 1.0) -> None:
        self.channel = channel
        self.worker = worker
        self.rpc_timeout_s = rpc_timeout_s
        self.heartbeat_s = heartbeat_s
        self.poll_s = 5.0  # longest wait of one Barrier call
        self.step = 0
        self.view: dict = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-worker{worker}", daemon=True)

    def _call(self, method: str, deadline_s: float | None = None, **meta: Any) -> dict:
        timeout = deadline_s or self.rpc_timeout_s
        reply = codec.decode(self.channel.call(method, codec.encode({"worker": self.worker, **meta}), timeout)
                             .wait(timeout))
        self.view = dict(reply.meta)
        return self.view

    def start(self, timeout: float) -> None:
        self.channel.wait_ready(timeout)
        self._call("Join")
        self._thread.start()

    def barrier(self, name: str, timeout: float | None = None, training_only: bool = False) -> dict:
        """Wait until every worker that has not exited (with `training_only`: nor finished its data)
        reached barrier `name`: as long as they are alive (polls of `poll_s`), or at most `timeout`
        seconds when given. Fails at once with UnavailableError when one it needs is dead."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = self.poll_s if deadline is None else max(0.0, min(self.poll_s, deadline - time.monotonic()))
            view = self._call("Barrier", wait + self.rpc_timeout_s, name=name, wait=wait,
                              training_only=training_only)
            if view.get("open"):
                return view
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(
                    f"barrier {name!r}: workers {view.get('waiting')} did not arrive in {timeout:.0f}s")

    def finish(self) -> dict:
        """Tell the coordinator this worker's data is done."""
        return self._call("Finish")

    def resume(self) -> dict:
        """Tell the coordinator this worker trains again after `finish` (it joins again)."""
        return self._call("Join")

    def request_checkpoint(self) -> dict:
        """Ask every worker for a checkpoint after its current step (the chief's timer)."""
        return self._call("RequestCheckpoint")

    def _beat(self) -> None:
        while not self._stopping.wait(self.heartbeat_s):
            try:
                self._call("Heartbeat", step=self.step)
            except ParamServerError as exc:
                log.warning("heartbeat to the coordinator failed: %s", exc)

    def stop(self) -> None:
        self._stopping.set()
        try:
            self._call("Leave", deadline_s=5.0)
        except ParamServerError as exc:
            log.info("leaving the coordinator: %s", exc)
        self._thread.join(5)
        self.channel.close()
