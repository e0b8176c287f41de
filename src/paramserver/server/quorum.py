"""Which workers a shard's sync steps and ssp bounds wait for.

A worker is out of the quorum while its data is done or while it waits at a barrier (it left),
and needed-but-gone once the coordinator found it dead. In an elastic run (`elastic`), a worker is
in only once it registered with this shard, and out again, for good, once the coordinator found
it gone: nothing waits for a slot no worker holds. It comes back with its next push or
registration; a push that comes from a barrier brings back everyone who waited there (the
barrier opened). A worker back from a start, a restart or a barrier is "returning": its next
sync push joins the step under way.

Not thread-safe: the Shard calls it under its own lock.
"""

from __future__ import annotations


class Quorum:
    def __init__(self) -> None:
        self.left: dict[int, str | None] = {}  # worker -> the barrier it waits at (None: its data is done)
        self.gone: dict[int, str] = {}  # worker -> why the coordinator declared it dead
        self.returning: set[int] = set()  # registered or left since its last push
        self.elastic = False
        self.present: set[int] = set()  # elastic: the workers registered here and not found gone since

    def registered(self, worker: int) -> None:
        self.returning.add(worker)
        self.gone.pop(worker, None)
        self.present.add(worker)

    def is_returning(self, worker: int | None) -> bool:
        return worker in self.returning or worker in self.left or self.elastic and worker not in self.present

    def out(self, worker: int) -> bool:
        """Whether sync steps and ssp bounds do without `worker` now."""
        return worker in self.left or self.elastic and worker not in self.present

    def pushed(self, worker: int | None, resumed: str | None) -> None:
        """Worker `worker` pushes (after barrier `resumed` opened, if given)."""
        if resumed is not None:
            for other in [w for w, at in self.left.items() if at == resumed]:
                del self.left[other]
                self.returning.add(other)
        if worker is not None:  # an async push may name no worker: no membership changes
            self.present.add(worker)
            self.left.pop(worker, None)
            self.returning.discard(worker)
            self.gone.pop(worker, None)

    def leave(self, worker: int, barrier: str | None) -> None:
        """Out of the quorum; a worker whose data is done stays so until its own next push, even if
        it then waits at a barrier."""
        if not (barrier is not None and worker in self.left and self.left[worker] is None):
            self.left[worker] = barrier
        self.gone.pop(worker, None)

    def forget(self, worker: int, why: str) -> None:
        """Recorded even while the worker is out of the quorum: a barrier's opening may bring it back.
        In an elastic run the worker is out instead, until it registers again."""
        if self.elastic:
            self.present.discard(worker)
            self.left.pop(worker, None)
            self.returning.discard(worker)
            return
        self.gone[worker] = why

    def size(self, quorum: int, workers: int) -> int:
        """How many pushes a sync step needs: the mode's quorum, at most the workers still in."""
        return max(1, min(quorum, workers - sum(self.out(w) for w in range(workers))))

    def awaited(self, workers: int, pushed: set[int]) -> list[int]:
        """Workers a step under way still waits for (in the quorum, not pushed yet)."""
        return [w for w in range(workers) if not self.out(w) and w not in pushed]

    def active(self, workers: int) -> list[int]:
        """The workers in the quorum (an ssp bound counts from the slowest of them)."""
        return [w for w in range(workers) if not self.out(w)]

    def needed_gone(self, workers: int, pushed: set[int], needed: int | None) -> list[int]:
        """Gone workers a wait still needs: for a sync step (`needed` pushes), only when the
        workers alive cannot make up the quorum without them; for an ssp bound, any."""
        awaited = self.awaited(workers, pushed)
        gone = [w for w in awaited if w in self.gone]
        if not gone or needed is None:
            return gone
        return gone if len(pushed) + len(awaited) - len(gone) < needed else []
