"""A checkpoint's shard files written in the background, from the chief's side.

`begin` asks every shard to take its cut (the shard's state at this instant, taken while the
workers are paused at the checkpoint's barrier) and to write its file on a thread of its own;
each answers at once. `CheckpointWrite.collect` then waits for the files while training goes on:
it asks each shard that still writes, in turns of `POLL_S` seconds (a long poll: the shard
answers when its file is done or the turn is over, saying how many bytes it wrote), so that no
deadline fails a shard that is alive and writing, however long its file takes. A shard that is
gone fails the next turn at once; one whose file has not grown for `STALL_S` seconds (a disk
that hangs) fails the write. Every shard's write ends (done or failed) before `collect` raises,
so none is left writing a file nobody collects. A shard of protocol 2.1 writes its file within
`begin`'s call: its reply is the entry.

Thread-safety: `begin` on the chief's training thread; `collect` on one thread (the chief's
commit thread) once `begin` returned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from paramserver.base.deadline import Deadline
from paramserver.base.errors import DeadlineExceededError, ParamServerError
from paramserver.wire import messages as msg
from paramserver.wire.stubs import ShardStub

log = logging.getLogger(__name__)
POLL_S = 10.0  # how long a shard holds a collect call before it answers "still writing"
LOG_EVERY_S = 30.0  # a write still under way is logged this often, naming the shards it waits for
STALL_S = 600.0  # a shard whose file does not grow for this long fails the write


def begin(stubs: Callable[[], Sequence[ShardStub]], name: str, timeout: float, parent: str = "") -> CheckpointWrite:
    """Have every shard take its cut of checkpoint `name` and write its file in the background (a delta
    on checkpoint `parent`, when given). `stubs()`: the shards' stubs now (partial recovery replaces one
    whose PS restarted: its successor refuses to collect a write it never began). A shard's refusal is
    kept in the result and raised by `collect`, once the others' files are written."""
    request = msg.CheckpointRequest(name=name, parent=parent, background=True)
    calls = [(index, stub.checkpoint(request, timeout)) for index, stub in enumerate(stubs())]
    deadline = Deadline(timeout)
    replies, refused = {}, {}
    for index, call in calls:
        try:
            replies[index] = call.wait(deadline.left())[0]
        except ParamServerError as exc:
            refused[index] = exc
    return CheckpointWrite(name, stubs, timeout, replies, refused)


class CheckpointWrite:
    """The files of checkpoint `name`: `done` holds the entries of those written already, `failed` the
    errors of shards that refused or failed, by shard index. `begun`: some shard writes or wrote a file.
    `holds_changes`: some shard's tables take no change until its file is written (tiered tables)."""

    def __init__(
        self,
        name: str,
        stubs: Callable[[], Sequence[ShardStub]],
        timeout: float,
        replies: dict[int, Any],
        refused: dict[int, ParamServerError],
    ) -> None:
        self.name, self.stubs, self.timeout = name, stubs, timeout
        self.count = len(replies) + len(refused)
        self.done = {index: reply.to_meta() for index, reply in replies.items() if not reply.pending}
        self.failed: dict[int, ParamServerError] = dict(refused)
        self.begun = bool(replies)
        self.holds_changes = any(reply.holds_changes for reply in replies.values())
        self._progress: dict[int, tuple[int, float]] = {}  # shard -> (bytes written, when they last grew)

    def collect(self) -> list[dict]:
        """Wait for every shard's file; returns the manifest entries in shard order. Raises the error of
        the first shard that refused or failed, once every other shard's write ended."""
        started = last_log = time.monotonic()
        request = msg.CheckpointRequest(name=self.name, collect=True, wait_s=POLL_S)
        while len(self.done) + len(self.failed) < self.count:
            waiting = [index for index in range(self.count) if index not in self.done and index not in self.failed]
            if time.monotonic() - last_log >= LOG_EVERY_S:
                last_log = time.monotonic()
                log.info(
                    "checkpoint %s: shards %s still write their files after %.0fs",
                    self.name,
                    waiting,
                    last_log - started,
                )
            stubs = self.stubs()
            self._poll([(index, stubs[index].checkpoint(request, POLL_S + self.timeout)) for index in waiting])
        if self.failed:
            raise self.failed[min(self.failed)]
        return [self.done[index] for index in range(self.count)]

    def _poll(self, calls: list[tuple[int, Any]]) -> None:
        """One turn: each call's outcome recorded (done, failed, or its progress)."""
        deadline = Deadline(POLL_S + self.timeout)
        for index, call in calls:
            try:
                reply = call.wait(deadline.left())[0]
            except ParamServerError as exc:
                self.failed[index] = exc
                continue
            if not reply.pending:
                self.done[index] = reply.to_meta()
            elif self._stalled(index, reply.written):
                self.failed[index] = DeadlineExceededError(
                    f"checkpoint {self.name}: shard {index}'s file has not grown for {STALL_S:.0f}s "
                    f"({reply.written} bytes written): its disk does not take writes"
                )

    def _stalled(self, index: int, written: int) -> bool:
        now = time.monotonic()
        before, since = self._progress.get(index, (-1, now))
        if written != before:
            self._progress[index] = (written, now)
            return False
        return now - since >= STALL_S
