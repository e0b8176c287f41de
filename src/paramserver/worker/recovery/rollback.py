"""Recovery inside the cluster: how a worker learns that the cluster rolls back, and what it does.

Without a launcher (`paramserver node` under Kubernetes or any restart loop), a PS or the chief
that restarted sends the cluster back to its latest checkpoint, as `paramserver run` does:
- each PS process and each coordinator has a random `incarnation` (in every Hello / coordinator
  reply); a new one means the process restarted and lost (or restored) its state;
- the chief watches the PS (`CoordinatorHost`), and every worker its coordinator (the heartbeat):
  a new incarnation flags the roll-back here (`RollbackFlag.flag`);
- the training thread then stops at its next step (RollbackError), or the process exits by itself
  after `grace_s`; `paramserver node` exits with RESTART_EXIT_CODE and the restart loop starts it
  again: it resumes at the checkpoint's data position;
- a chief that starts while any PS holds state (it restarted, or it left because a PS did) asks
  every PS to restart before it serves the coordinator (`roll_back_shards`): every PS then holds
  the latest checkpoint, and no worker joins before that. All of them, not only those holding
  state: a worker from before the roll-back may still register with a PS that looked fresh and
  push to it, and that PS would then count batches (a position in the next checkpoint) that the
  restarted ones never saw.
A PS takes pushes only from workers that registered with its current process, so a worker from
before the roll-back can change nothing on it (server/shard.py, `sessions`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from paramserver.base.errors import ParamServerError, RollbackError, UnavailableError
from paramserver.base.lifecycle import RESTART_EXIT_CODE
from paramserver.client.ps_client import HELLO_TIMEOUT_S, hello
from paramserver.wire import messages as msg
from paramserver.wire.stubs import ShardStub

log = logging.getLogger(__name__)


class RollbackFlag:
    """Whether this worker learned that the cluster rolls back, and why.

    Thread-safe: `flag` from any thread (heartbeat, coordinator-watch); `check` from the training
    thread. The first flag arms a named thread ("rollback-exit") that ends the process with
    RESTART_EXIT_CODE if it is still running `grace_s` seconds later (a training thread blocked in
    a call to a PS that is gone must not hold the roll-back up)."""

    def __init__(self, grace_s: float, exit_process: Callable[[int], None] = os._exit) -> None:
        self.grace_s = grace_s
        self.reason: str | None = None
        self._lock = threading.Lock()
        self._exit_process = exit_process

    def flag(self, reason: str) -> None:
        with self._lock:
            if self.reason is not None:
                return
            self.reason = reason
        log.warning("the cluster rolls back to its latest checkpoint: %s", reason, extra={"event": "rollback_flagged"})
        threading.Thread(target=self._exit_later, name="rollback-exit", daemon=True).start()

    def check(self) -> None:
        """Raise RollbackError when flagged (called by the training thread between steps)."""
        if self.reason is not None:
            raise RollbackError(f"the cluster rolls back: {self.reason}")

    def _exit_later(self) -> None:
        time.sleep(self.grace_s)  # not a verdict: the training thread had its chance to stop cleanly
        log.warning("still running %.0fs after the roll-back began; exiting with %d", self.grace_s, RESTART_EXIT_CODE)
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._exit_process(RESTART_EXIT_CODE)


def restarted_shard(channels: list, expected: list[str | None]) -> str | None:
    """Why a shard is no longer the process this worker registered with, or None. A shard that
    does not answer is down: it will come back restarted."""
    for index, (channel, incarnation) in enumerate(zip(channels, expected)):
        if incarnation is None:  # an in-process shard: never restarts
            continue
        try:
            now = hello(channel).get("incarnation")
        except ParamServerError as exc:
            return f"ps {index} does not answer ({exc})"
        if now != incarnation:
            return f"ps {index} restarted (incarnation {incarnation} is now {now})"
    return None


def roll_back_shards(channels: list, timeout: float) -> list[int]:
    """If any shard holds state (a worker registered with it), ask every shard to restart from the
    latest checkpoint, and wait until each is back as a new process; returns the shards restarted.

    Called by a chief before it serves the coordinator: at a fresh start no shard holds state."""
    if not any(_holds_state(channel) for channel in channels):
        return []
    shards = list(range(len(channels)))
    started = time.monotonic()
    log.warning(
        "the chief starts while ps hold state: the cluster rolls back; asking ps %s to restart from the "
        "latest checkpoint",
        shards,
        extra={"event": "rollback_started"},
    )
    before = {index: hello(channels[index]).get("incarnation") for index in shards}
    request = msg.ShutdownRequest(reason="roll-back by the chief", restart=True)
    for index in shards:
        ShardStub(channels[index]).shutdown(request, HELLO_TIMEOUT_S).wait(HELLO_TIMEOUT_S)
    for index in shards:
        _wait_restarted(channels[index], index, before[index], started + timeout)
    took = time.monotonic() - started
    log.warning(
        "ps %s restarted from the latest checkpoint in %.2fs",
        shards,
        took,
        extra={"event": "rollback_done", "duration_s": round(took, 3)},
    )
    return shards


def _holds_state(channel) -> bool:
    meta = getattr(channel, "hello", None) or {}
    return bool(meta.get("groups") or meta.get("tables"))


def _wait_restarted(channel, index: int, before: str | None, deadline: float) -> None:
    """Until shard `index` answers as a process other than `before` (its restart loop started it again)."""
    while True:
        try:
            if hello(channel).get("incarnation") != before:
                return
        except ParamServerError:
            pass  # down while it restarts
        if time.monotonic() >= deadline:
            raise UnavailableError(
                f"ps {index} did not come back after the roll-back asked it to restart: is it "
                f"run under a restart loop (Kubernetes restartPolicy, docs/deploy.md)?"
            )
        time.sleep(0.2)  # polling a restarting process; the deadline above is the verdict
