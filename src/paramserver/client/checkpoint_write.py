"""A checkpoint's shard files written in the background, from the chief's side.

`begin` asks every shard to take its cut (the shard's state at this instant, taken while the
workers are paused at the checkpoint's barrier) and to write its file on a thread of its own;
each answers at once. `CheckpointWrite.collect` then waits for the files while training goes on:
it asks each shard that still writes, in turns of `POLL_S` seconds (a long poll: the shard
answers when its file is done or the turn is over), so that no deadline fails a shard that is
alive and writing, however long its file takes, and a shard that is gone fails the next turn at
once. A shard of protocol 2.1 writes its file within `begin`'s call: its reply is the entry.

Thread-safety: `begin` on the chief's training thread; `collect` on one thread (the chief's
commit thread) once `begin` returned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from paramserver.base.deadline import Deadline
from paramserver.base.errors import ParamServerError
from paramserver.wire import messages as msg
from paramserver.wire.stubs import ShardStub

log = logging.getLogger(__name__)
POLL_S = 10.0  # how long a shard holds a collect call before it answers "still writing"
LOG_EVERY_S = 30.0  # a write still under way is logged this often, naming the shards it waits for


def begin(stubs: Sequence[ShardStub], name: str, timeout: float, parent: str = "") -> CheckpointWrite:
    """Have every shard take its cut of checkpoint `name` and write its file in the background (a delta
    on checkpoint `parent`, when given). Every shard answers before a failure is raised, so that none is
    left writing unknown to the caller."""
    request = msg.CheckpointRequest(name=name, parent=parent, background=True)
    replies = _answers([(index, stub.checkpoint(request, timeout)) for index, stub in enumerate(stubs)], timeout)
    return CheckpointWrite(name, list(stubs), timeout, replies)


class CheckpointWrite:
    """The files of checkpoint `name` being written by `stubs`' shards; `done` holds the entries of
    those written already, by shard index."""

    def __init__(self, name: str, stubs: list[ShardStub], timeout: float, replies: dict[int, Any]) -> None:
        self.name, self.stubs, self.timeout = name, stubs, timeout
        self.done = {index: reply.to_meta() for index, reply in replies.items() if not reply.pending}

    def collect(self) -> list[dict]:
        """Wait for every shard's file; returns the manifest entries in shard order. Raises the first
        shard's error once every shard answered (a shard that is gone: its call's error)."""
        started = last_log = time.monotonic()
        request = msg.CheckpointRequest(name=self.name, collect=True, wait_s=POLL_S)
        while len(self.done) < len(self.stubs):
            waiting = [index for index in range(len(self.stubs)) if index not in self.done]
            if time.monotonic() - last_log >= LOG_EVERY_S:
                last_log = time.monotonic()
                log.info(
                    "checkpoint %s: shards %s still write their files after %.0fs",
                    self.name,
                    waiting,
                    last_log - started,
                )
            calls = [(index, self.stubs[index].checkpoint(request, POLL_S + self.timeout)) for index in waiting]
            for index, reply in _answers(calls, POLL_S + self.timeout).items():
                if not reply.pending:
                    self.done[index] = reply.to_meta()
        return [self.done[index] for index in range(len(self.stubs))]


def _answers(calls: list[tuple[int, Any]], timeout: float) -> dict[int, Any]:
    """Every call's reply by shard index; the first error raised once all answered."""
    deadline = Deadline(timeout)
    replies, errors = {}, []
    for index, call in calls:
        try:
            replies[index] = call.wait(deadline.left())[0]
        except ParamServerError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    return replies
