"""Periodic checkpoints from the workers' side: pause at a step, let every shard write, commit.

Every `every` steps (each worker's own count), or every `every_seconds` by the chief's clock
(the chief asks through the coordinator; the others learn it from their next heartbeat reply
and stop after their current step), all workers meet at a barrier, so no push is in
flight and every shard holds the same set of applied pushes (pause-apply-snapshot: a cut that is
consistent across shards in async mode too, at the price of one pause per checkpoint). The chief
then has every shard write its file, writes the manifest (the commit), prunes old checkpoints,
and a second barrier lets everyone go on. A checkpoint that fails (a full disk, an unreachable
store) is logged as an error and training goes on: the previous checkpoint stays the latest.
Not thread-safe: call from the training thread.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ..checkpoint.store import CheckpointStore, checkpoint_name
from ..errors import ParamServerError

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, client, store: CheckpointStore | None, every: int, keep: int, worker_index: int,
                 barrier: Callable[[str, float], None], every_seconds: float = 0.0, coordinator=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.store = store
        self.every = every if store is not None else 0
        self.every_seconds = every_seconds if store is not None and coordinator is not None else 0.0
        self.keep = keep
        self.worker_index = worker_index
        self.barrier = barrier
        self.coordinator = coordinator
        self._clock = clock
        self._last = clock()
        self._timed_done = self._requested()  # timed checkpoints met (or asked for before this worker started)
        self._barrier_after: dict[int, str] = {}  # step -> the barrier `due` decided on for it

    def due(self, step: int) -> bool:
        """Whether the workers meet after `step`; decided here, once, so that the optimizer can
        make sure nothing of this worker is in flight before `on_step(step)` meets them."""
        if step in self._barrier_after:
            return True
        if self.every_seconds and self.worker_index == 0 and self._requested() <= self._timed_done \
                and self._clock() - self._last >= self.every_seconds:
            self.coordinator.request_checkpoint()
        if self._requested() > self._timed_done:
            self._timed_done = self._requested()
            self._barrier_after[step] = f"checkpoint#{self._timed_done}"
        elif self.every > 0 and step > 0 and step % self.every == 0:
            self._barrier_after[step] = f"checkpoint@{step}"
        return step in self._barrier_after

    def _requested(self) -> int:
        return int(self.coordinator.view.get("checkpoints_requested", 0)) if self.coordinator is not None else 0

    def on_step(self, step: int, timeout: float) -> None:
        if self.due(step):
            self._meet(self._barrier_after.pop(step), step, timeout)

    def _meet(self, barrier: str, step: int, timeout: float) -> None:
        self.barrier(barrier, timeout)
        try:
            if self.worker_index == 0:
                self.save(step, timeout)
        except ParamServerError:
            pass  # logged by save(); the previous checkpoint stays the latest
        finally:
            self._last = self._clock()
            self.barrier(f"{barrier}:written", timeout)

    def save(self, step: int, timeout: float) -> str:
        """Write checkpoint `step` now (chief only; no push may be in flight). Returns its name."""
        name, started = checkpoint_name(step), time.monotonic()
        log.info("checkpoint %s: writing %d shards to %s", name, len(self.client.channels), self.store.url)
        try:
            entries = self.client.checkpoint(self.store.url, name, timeout)
            self.store.commit(name, {"step": step, "num_shards": len(entries), "shards": entries,
                                     "mode": self.client.consistency.to_dict()})
        except ParamServerError as exc:
            log.error("checkpoint %s failed after %.2fs; the previous one stays: %s", name,
                      time.monotonic() - started, exc)
            raise
        removed = self.store.prune(self.keep)
        log.info("checkpoint %s: committed (%d bytes) in %.2fs%s", name, sum(e["bytes"] for e in entries),
                 time.monotonic() - started, f"; removed {', '.join(removed)}" if removed else "")
        return name
