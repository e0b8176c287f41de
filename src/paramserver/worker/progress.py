"""The progress channel between a worker and `paramserver run`.

A worker writes JSON lines to a file descriptor the launcher gave it:
``{"worker": i, "steps": n, "examples": n, "loss": x, "staleness_sum": n, "pushed_bytes": n, "t": unix_time}``
(`pushed_bytes`: the PushPull requests' bytes that carried gradients) at most every
`interval` seconds, ``{"worker": i, "result": {...}}`` for the run's final JSON line (each result
line adds its keys to the worker's earlier ones), and ``{"worker": i, "done": true}`` once the
worker finished its script (the launcher never restarts a worker that said so, even if it is
killed afterwards), and ``{"worker": i, "lost": {"shard": s, "incarnation": ..., "steps": n,
"checkpoint": ..., "wait_s": x}}`` after a shard was restored alone (partial recovery): how many of
this worker's steps it lost.
`t` is the time of the worker's latest step, not of the write: a line written after training
(with the result, after an evaluation) does not stretch the run's examples/s.
The launcher's ProgressBoard aggregates the lines of all workers; once frozen (the run was
interrupted) it ignores further counts and results.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


class ProgressWriter:
    """Worker side. Not thread-safe: the training loop calls it. A writer with fd -1 does nothing."""

    def __init__(self, fd: int, worker: int, interval: float = 0.5) -> None:
        self._file = os.fdopen(fd, "w", buffering=1) if fd >= 0 else None
        self.worker = worker
        self.interval = interval
        self.steps = 0
        self.examples = 0
        self.loss: float | None = None
        self.staleness_sum = 0
        self.pushed_bytes = 0  # set by the worker: its PSClient's count
        self._last_write = 0.0
        self._step_t: float | None = None
        self._done = False

    def update(self, steps: int = 0, examples: int = 0, loss: float | None = None, staleness: int = 0) -> None:
        self.steps += steps
        self.examples += examples
        self.staleness_sum += staleness
        if steps or examples:
            self._step_t = time.time()
        if loss is not None:
            self.loss = loss
        if self._file and time.monotonic() - self._last_write >= self.interval:
            self.flush()

    def count_step(self, staleness: int = 0) -> None:
        """`update(steps=1, staleness=staleness)`, made for the per-step path: a writer with no
        channel reads no clock."""
        self.steps += 1
        self.staleness_sum += staleness
        if self._file:
            self._step_t = time.time()
            if time.monotonic() - self._last_write >= self.interval:
                self.flush()

    def flush(self) -> None:
        self._write(
            {
                "steps": self.steps,
                "examples": self.examples,
                "loss": self.loss,
                "staleness_sum": self.staleness_sum,
                "pushed_bytes": self.pushed_bytes,
                "t": self._step_t if self._step_t is not None else time.time(),
            }
        )
        self._last_write = time.monotonic()

    def result(self, values: dict[str, Any]) -> None:
        self.flush()
        self._write({"result": values})

    def lost(self, shard: int, incarnation: str, steps: int, checkpoint: str, wait_s: float) -> None:
        """Shard `shard` came back as process `incarnation`, restored from `checkpoint`, having lost `steps`
        of this worker's steps; this worker waited `wait_s` seconds for it (partial recovery)."""
        record = {"shard": shard, "incarnation": incarnation, "steps": steps, "checkpoint": checkpoint}
        self._write({"lost": {**record, "wait_s": round(wait_s, 3)}})

    def done(self) -> None:
        """Tell the launcher this worker finished its script: the final counts, then the done line.
        Idempotent. After it, the launcher counts the worker as finished even if it is killed."""
        if self._done:
            return
        self._done = True
        self.flush()
        self._write({"done": True})

    def undone(self) -> None:
        """This worker trains again after `done()` (a push after its data was finished)."""
        if self._done:
            self._done = False
            self._write({"done": False})

    def close(self, done: bool = True) -> None:
        """Close the channel (idempotent); later updates are not written. Sends the done line first
        unless it was sent already or `done` is False (the script did not finish)."""
        if self._file:
            if done:
                self.done()
            if self._file:  # done() drops the file when the launcher went away
                self._file.close()
                self._file = None

    def _write(self, record: dict[str, Any]) -> None:
        if self._file:
            try:
                self._file.write(json.dumps({"worker": self.worker, **record}) + "\n")
            except (OSError, ValueError):  # the launcher went away; training goes on
                self._file = None


_CHECKPOINT_COUNTS = ("checkpoints_written", "checkpoints_failed")


class ProgressBoard:
    """Launcher side: the latest line of each worker, and their results. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[int, dict[str, Any]] = {}
        self._banked = {
            "steps": 0,
            "examples": 0,
            "staleness_sum": 0,
            "pushed_bytes": 0,
        }  # totals of workers since restarted
        self._banked_steps: dict[int, int] = {}  # per worker: the steps of its runs before its restarts
        # (totals, per-worker steps) when the chief last reported a new checkpoint: a roll-back goes back there
        self._at_checkpoint: tuple[dict[str, int], dict[int, int]] = (dict(self._banked), {})
        self._cuts: dict[str, tuple[dict[str, int], dict[int, int]]] = {}  # checkpoint -> the snapshot at its cut
        self.steps_redone = 0  # steps trained after the checkpoint a roll-back went back to
        self._counts_before: dict[str, int] = {}  # the chief's checkpoint counts of its runs before a roll-back
        self._first_t: float | None = None
        self._first_examples = 0  # counted by the first line, so done before _first_t
        self.results: dict[int, dict[str, Any]] = {}
        self._recoveries: dict[tuple[int, str], dict[str, Any]] = {}  # partial recoveries, by (shard, incarnation)
        self._done: set[int] = set()
        self._frozen = False
        self._window = (time.time(), 0, 0)

    def feed(self, line: str) -> None:
        try:
            record = json.loads(line)
            worker = int(record["worker"])
        except (ValueError, KeyError, TypeError):
            return
        with self._lock:
            if record.get("done"):
                self._done.add(worker)
            elif record.get("done") is False:
                self._done.discard(worker)
            elif self._frozen:
                return
            elif "result" in record:  # several result lines add up (a later value of a key wins)
                self._take_result(worker, record["result"])
            elif "lost" in record:
                self._take_lost(worker, record["lost"])
            else:
                self._latest[worker] = record
                if self._first_t is None:
                    self._first_t, self._first_examples = record["t"], record.get("examples", 0)

    def _take_result(self, worker: int, values: dict[str, Any]) -> None:
        """Under the lock. The chief's checkpoint counts go on from its runs before a roll-back; a new
        checkpoint is where the next roll-back goes back to: the totals when its cut was taken (the
        chief says `checkpoint_cut` then; its files are committed while training goes on)."""
        if worker == 0:
            values = {k: v + self._counts_before.get(k, 0) if k in _CHECKPOINT_COUNTS else v for k, v in values.items()}
            cut = values.pop("checkpoint_cut", None)
            if cut is not None:
                self._cuts = {**dict(list(self._cuts.items())[-3:]), str(cut): self._snapshot()}
            if values.get("checkpoints_written", 0) > self.results.get(0, {}).get("checkpoints_written", 0):
                latest = self._cuts.pop(str(values.get("checkpoint_latest")), None)
                self._at_checkpoint = latest if latest is not None else self._snapshot()
            values.pop("checkpoint_latest", None)
        self.results.setdefault(worker, {}).update(values)

    def _take_lost(self, worker: int, lost: dict[str, Any]) -> None:
        """Under the lock: a worker's steps lost by a shard restored alone, added to that recovery's."""
        try:
            key, steps = (int(lost["shard"]), str(lost["incarnation"])), int(lost["steps"])
        except (KeyError, TypeError, ValueError):
            return
        entry = self._recoveries.setdefault(
            key, {"shard": key[0], "checkpoint": lost.get("checkpoint"), "steps_lost": 0, "by_worker": {}}
        )
        entry["by_worker"][str(worker)] = entry["by_worker"].get(str(worker), 0) + steps
        entry["steps_lost"] += steps
        entry["wait_s"] = max(entry.get("wait_s", 0.0), float(lost.get("wait_s", 0.0)))

    def partial_recoveries(self) -> list[dict[str, Any]]:
        """Each shard restored alone, in order: its checkpoint, the steps it lost (by worker and in all),
        the longest a worker waited for it."""
        with self._lock:
            return [dict(entry, by_worker=dict(entry["by_worker"])) for entry in self._recoveries.values()]

    def _snapshot(self) -> tuple[dict[str, int], dict[int, int]]:
        """Under the lock: the totals and each worker's steps now."""
        totals = dict(self._banked)
        for record in self._latest.values():
            for key in totals:
                totals[key] += record.get(key, 0)
        steps = dict(self._banked_steps)
        for worker, record in self._latest.items():
            steps[worker] = steps.get(worker, 0) + record.get("steps", 0)
        return totals, steps

    def is_done(self, worker: int) -> bool:
        """Whether `worker` (its current run, since the last restart) reported that it finished its script."""
        with self._lock:
            return worker in self._done

    def freeze(self) -> dict[str, Any]:
        """Stop counting: lines fed from now on change neither the totals nor the results (a stopping
        worker's last steps are not the run's). Returns the totals at this moment."""
        with self._lock:
            self._frozen = True
        return self.totals()

    def restart(self, worker: int | None = None) -> None:
        """A worker (or, with None, every worker) starts again from zero: keep what it reported so
        far in the totals."""
        with self._lock:
            if worker is None:  # a roll-back: the steps since the latest checkpoint are trained again
                self._roll_back()
                return
            if worker == 0:
                self._keep_counts()
            for index in [worker]:
                record = self._latest.pop(index, {})
                self._banked_steps[index] = self._banked_steps.get(index, 0) + record.get("steps", 0)
                for key in self._banked:
                    self._banked[key] += record.get(key, 0)
            self._done.discard(worker)

    def _roll_back(self) -> None:
        """Under the lock: every worker starts again from the latest checkpoint, whose totals stay."""
        steps_now = self._snapshot()[0]["steps"]
        totals, steps = self._at_checkpoint
        self.steps_redone += max(0, steps_now - totals["steps"])
        self._banked, self._banked_steps = dict(totals), dict(steps)
        self._latest.clear()
        self._done.clear()
        self._keep_counts()

    def _keep_counts(self) -> None:
        """Under the lock: the chief restarts; its checkpoint counts so far stay the run's."""
        chief = self.results.get(0, {})
        self._counts_before = {key: chief[key] for key in _CHECKPOINT_COUNTS if key in chief}

    def steps_by_worker(self) -> dict[int, int]:
        """Each worker's steps so far, its runs before restarts included (a worker that reported none is absent
        unless it was restarted)."""
        with self._lock:
            steps = dict(self._banked_steps)
            for worker, record in self._latest.items():
                steps[worker] = steps.get(worker, 0) + record.get("steps", 0)
        return steps

    def run_record(self, ps: int, workers: int, wall_s: float, **extra: Any) -> dict[str, Any]:
        """A launcher's closing record of the run: totals, then `extra`, what recovery redid or lost
        (`steps_redone` after a roll-back, not in `steps`; `partial_recoveries`: shards restored alone),
        then the workers' results (worker 0's win)."""
        if self.steps_redone:
            extra["steps_redone"] = self.steps_redone
        recoveries = self.partial_recoveries()
        if recoveries:
            extra["partial_recoveries"] = recoveries
        totals = self.totals()
        steps = totals["steps"]
        record: dict[str, Any] = {
            "ps": ps,
            "workers": workers,
            "steps": steps,
            "examples": totals["examples"],
            "examples_per_s": round(totals["examples_per_s"], 1),
            "staleness_mean": round(totals["staleness_mean"], 3),
            "pushed_bytes": totals["pushed_bytes"],
            "pushed_bytes_per_step": round(totals["pushed_bytes"] / steps) if steps else 0,
            "wall_s": round(wall_s, 2),
            **extra,
        }
        for worker in sorted(self.results, reverse=True):
            record.update(self.results[worker])
        return record

    def totals(self) -> dict[str, Any]:
        """Summed steps and examples, mean last loss, steps/s and examples/s since the previous call, and
        `examples_per_s` of the run: examples after the first line over the time from it to the latest step."""
        with self._lock:
            latest = list(self._latest.values())
            first_t, first_examples = self._first_t, self._first_examples
        steps = self._banked["steps"] + sum(r["steps"] for r in latest)
        examples = self._banked["examples"] + sum(r["examples"] for r in latest)
        losses = [r["loss"] for r in latest if r.get("loss") is not None]
        staleness = self._banked["staleness_sum"] + sum(r.get("staleness_sum", 0) for r in latest)
        pushed_bytes = self._banked["pushed_bytes"] + sum(r.get("pushed_bytes", 0) for r in latest)
        now = time.time()
        since, examples_before, steps_before = self._window
        self._window = (now, examples, steps)
        last_t = max((r["t"] for r in latest), default=now)
        elapsed = max(now - since, 1e-9)
        return {
            "steps": steps,
            "examples": examples,
            "loss": sum(losses) / len(losses) if losses else None,
            "staleness_mean": staleness / steps if steps else 0.0,
            "pushed_bytes": pushed_bytes,
            "recent_steps_per_s": (steps - steps_before) / elapsed,
            "recent_examples_per_s": (examples - examples_before) / elapsed,
            "examples_per_s": (
                (examples - first_examples) / (last_t - first_t) if first_t and last_t > first_t else 0.0
            ),
        }
