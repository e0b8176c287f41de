"""`paramserver run`: a whole cluster of separate processes on this machine.

PS processes start first on 127.0.0.1 port 0 and announce their ports; then the workers
start with a TF_CONFIG naming those ports and run the script. Every output line is
prefixed with its node ("[ps0] ...", "[worker1] ..."); a progress line sums the
workers' steps, examples/s and loss. The run ends when every worker has exited: with 0 if
all succeeded, else with the first failing worker's code, and no child left behind.

Recovery from a node killed by a signal (SIGKILL, the OOM killer, a crash), at most
`max_restarts` times in all: in every mode a worker other than the chief is restarted alone
(the others never stop; it adopts the PS's values, resumes its data at its position as the PS
counted it, and in sync mode joins the step under way). A PS or the chief hosting the
coordinator, with checkpoints on (`checkpoint_dir`), makes the launcher roll the whole cluster back: it stops
every node and starts them all again with `resume`, so every shard and every worker's data
position go back to the same checkpoint. A worker that exits with an error code (a bug in the
script) still ends the run. A worker that reported it finished its data (ProgressWriter.done)
and is killed afterwards counts as finished: it is neither restarted nor a cause of a roll-back
(the chief excepted while other workers run: they need its coordinator).

Stopping (Ctrl-C, SIGTERM, the end of the run, a roll-back) SIGTERMs every node at once, workers
first, waits for all of them together and SIGKILLs what is left after the grace. On an
interrupt the progress board is frozen first, so the closing JSON line counts the steps up to
the interrupt, not those the workers took while stopping.

An elastic run (`max_workers` M > 0, docs/elastic.md) reserves M worker slots and starts the
`num_workers` first; `paramserver scale` changes how many run (launch/local/elastic.py). There a
worker other than the chief that is killed with no restart left, or asked to leave, is a leave, not
a failure: the others train on. The closing line lists the joins and leaves (`membership`).

A run given a checkpoint directory asks for checkpoints (periodic ones, and the final one at a
clean end). The chief reports how many it wrote and how many failed (the closing JSON line's
`checkpoints_written`, `checkpoints_failed`, `checkpoint_error`); a run that trained to its end
but whose latest checkpoint failed exits with NO_CHECKPOINT (3) and says why.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO, cast

import psutil

from paramserver.base.config import OPTIONS_ENV, TF_CONFIG_ENV, Options
from paramserver.base.errors import ConfigError, FailedPreconditionError, UnavailableError
from paramserver.base.lifecycle import RESTART_EXIT_CODE, Lifecycle, ReadyFlag
from paramserver.launch import threads
from paramserver.launch.local import elastic
from paramserver.launch.local.ports import free_port
from paramserver.launch.local.processes import Child, LineWriter, stop_all, wait_any
from paramserver.launch.local.run_files import LauncherFiles
from paramserver.launch.local.shard_restart import how_lost, lost_shard, restart_line, why_not_alone
from paramserver.node.ps_process import READY_PREFIX
from paramserver.security.certs import ps_node_name, with_node_tls, worker_node_name
from paramserver.security.tokens import with_node_token
from paramserver.worker.progress import ProgressBoard

log = logging.getLogger(__name__)
_MEMORY_EVERY_S = 0.5  # how often the nodes' resident memory is sampled for the peak figures
_TREE_EVERY_S = 2.0  # how often the nodes' child processes (data loaders) are listed again
_PROGRESS_EOF_S = 5.0  # how long to wait for a dead worker's last progress lines (normally instant)
NO_CHECKPOINT = 3  # exit code: the run succeeded but its latest checkpoint failed
_PS_OPTIMIZERS = (
    "a cluster trains through paramserver optimizers (ps.optim.SGD, ps.optim.Adam, ps.Trainer, ...), "
    "which push each step to the PS; a torch.optim optimizer trains a private copy on each worker, which "
    "nothing shares or saves"
)
EVALUATOR_GRACE_S = 60.0  # after a clean end: how long the evaluator may take over the final checkpoint
EVALUATOR_PROGRESS = -1  # the evaluator's index on the progress board (it reports only a failure)


def default_torch_threads(num_workers: int) -> int:
    """The cores idle now shared out among the workers, at least 1 (launch/threads.py)."""
    return threads.measure(num_workers).torch_threads


class LocalCluster(Lifecycle):
    """N PS and M worker processes running one script.

    Lifecycle (base/lifecycle.py): `start(timeout)` starts the PS, waits until each announced its
    address (at most `timeout` seconds), then starts the workers; `wait_ready(timeout)` says whether
    that succeeded; `wait()` (the exit code); `stop(grace)` (idempotent, callable from any thread,
    also during or after a failed start: a node is never started after it). When `stop` returns,
    every node it started has exited and been reaped, and its threads ("run-watch",
    "progress-worker<i>", "log-<node>") are joined (bounded). `run()` is start + wait + stop.
    """

    def __init__(
        self,
        num_ps: int,
        num_workers: int,
        script: str,
        args: list[str] | None = None,
        options: Options | None = None,
        out: TextIO | None = None,
        progress_every: float = 2.0,
        log_level: str = "INFO",
        max_restarts: int = 3,
        certs: Path | None = None,
        tokens: str | None = None,
        evaluator: bool = False,
    ) -> None:
        """`certs`: a `paramserver certs` directory (mutual TLS, each node its own certificate);
        `tokens`: a directory of security/tokens.py's files (each node presents its own token, checked
        by the PS and the coordinator); `evaluator`: one evaluator task runs the script too, following
        the checkpoints (docs/evaluator.md); its exit code never counts."""
        if num_ps < 1 or num_workers < 1:
            raise ValueError(f"need at least 1 PS and 1 worker, got ps={num_ps} workers={num_workers}")
        self.num_ps, self.num_workers = num_ps, num_workers
        self.script, self.args = script, list(args or [])
        self.options = options or Options(torch_threads=default_torch_threads(num_workers))
        self.progress_every = progress_every
        self.log_level = log_level
        self.max_restarts = max_restarts
        self.certs = certs  # mutual TLS: each node's own certificate from this `paramserver certs` directory
        self.tokens = tokens
        self.restarts = 0
        max_workers = self.options.max_workers
        if max_workers and not num_workers <= max_workers:
            raise ValueError(f"an elastic run of up to {max_workers} workers cannot start {num_workers}")
        # an elastic run's wanted count, scale wishes and joins and leaves; None: a fixed worker set
        self.elastic = elastic.WorkerSet(max_workers, num_workers) if max_workers else None
        self.with_evaluator = evaluator
        self.evaluator: Child | None = None  # reads checkpoints only: started once, kept through roll-backs
        self.board = ProgressBoard()
        self.peak_rss: dict[str, int] = {"ps": 0, "worker": 0}
        self.ps: list[Child] = []
        self.workers: list[Child] = []
        self._progress_readers: dict[int, threading.Thread] = {}
        self.ps_addresses: list[str | None] = [None] * num_ps
        self.worker_addresses: list[str] = []
        self._ps_ready = threading.Condition()
        self._lines = LineWriter(out or sys.stdout, json_lines=self.options.log_format == "json")
        self._stopped = threading.Event()
        self._nodes_lock = threading.Lock()  # no node starts once stop() began
        self._spawned: list[Child] = []  # every node started, for stop() (one may not be in ps/workers yet)
        self.ready = ReadyFlag(f"local cluster of {num_ps} PS and {num_workers} workers")
        self._started_at = 0.0
        self.wall_s = 0.0
        self._watcher: threading.Thread | None = None
        self.run_file: Path | None = None  # this run's cluster file, while it runs
        self._run_files: LauncherFiles | None = (
            None  # its secret (every node's) and run file (launch/local/run_files.py)
        )

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        """Start the PS, wait until each announced its address, then start the workers."""
        try:
            self._start(timeout)
        except BaseException as exc:
            self.ready.fail(exc)
            raise
        self.ready.set()

    def _start(self, timeout: float) -> None:
        if not self._started_at:  # the first start, not a roll-back's
            self._started_at = time.monotonic()
            self._make_run_files()
        for i in range(self.num_ps):
            argv = self._node_argv("--role", "ps", "--index", str(i), "--bind", "127.0.0.1:0")
            self.ps.append(self._spawn(f"ps{i}", argv, self._env(self._node_options(ps_node_name(i)))))
        self._wait_ps_ready(timeout)
        # worker 0 serves the coordinator on its address; the others' (an elastic run's every slot) are reserved too
        slots = self.elastic.max_workers if self.elastic else self.num_workers
        self.worker_addresses = [f"127.0.0.1:{free_port()}" for _ in range(slots)]
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="run-watch", daemon=True)
            self._watcher.start()
        self._write_run_file()
        for i in range(self.elastic.wanted if self.elastic else self.num_workers):
            self.workers.append(self._start_worker(i))
        if self.with_evaluator and self.evaluator is None:
            config = json.dumps(
                {
                    "cluster": {"ps": self.ps_addresses, "worker": self.worker_addresses},
                    "task": {"type": "evaluator", "index": 0},
                }
            )
            self.evaluator = self._spawn_reporting("evaluator0", EVALUATOR_PROGRESS, self.options, config)

    def _make_run_files(self) -> None:
        """The run's secret, which every node is handed, before any starts (launch/local/run_files.py). A runs
        directory that is refused (or cannot be written) costs the run its run file, not its start."""
        try:
            self._run_files = LauncherFiles.create()
        except (ConfigError, OSError) as exc:
            self._lines.write("run", f"no run file: {exc}; `paramserver status` needs a cluster file")

    def _write_run_file(self) -> None:
        """Where `paramserver status` (no argument) finds this run (launch/local/run_files.py); said once."""
        if self._run_files is None:
            return
        cluster = {"ps": [a for a in self.ps_addresses if a], "worker": self.worker_addresses}
        first = self.run_file is None
        try:
            self.run_file = self._run_files.write(cluster, self.elastic.max_workers if self.elastic else 0)
            if self.elastic:
                self.elastic.wish_path = elastic.scale_path(self.run_file)
        except OSError as exc:
            self._lines.write("run", f"cannot write the cluster file: {exc}; `paramserver status` needs a cluster file")
            return
        if first:
            self._lines.write("run", f"cluster file: {self.run_file} (`paramserver status` finds it)")

    def wait_ready(self, timeout: float) -> None:
        """Every PS announced its address and every worker was started (what `start` waits for)."""
        self.ready.wait(timeout)

    def _spawn(self, label: str, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> Child:
        with self._nodes_lock:
            if self._stopped.is_set():
                raise UnavailableError(f"the cluster is stopping: {label} not started")
            child = Child(label, argv, env, self._on_line, pass_fds=pass_fds)
            self._spawned.append(child)
            return child

    def _start_worker(self, index: int) -> Child:
        options = self._node_options(worker_node_name(index))
        if self.elastic:
            self.elastic.record(index, "started")
        return self._spawn_reporting(f"worker{index}", index, options, self._tf_config(index))

    def _spawn_reporting(self, label: str, index: int, options: Options, tf_config: str) -> Child:
        """Start the script on a node that reports on a progress pipe of its own (a worker, the evaluator)."""
        read_fd, write_fd = os.pipe()
        env = self._env(replace(options, progress_fd=write_fd), tf_config)
        try:
            child = self._spawn(label, self._node_argv(self.script, *self.args), env, pass_fds=(write_fd,))
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        reader = threading.Thread(target=self._read_progress, args=(read_fd,), name=f"progress-{label}", daemon=True)
        reader.start()
        self._progress_readers[index] = reader
        return child

    def _drain_progress(self, index: int) -> None:
        """Wait until every progress line worker `index` wrote was fed to the board (its pipe reached
        end of file: the worker and its group are gone)."""
        reader = self._progress_readers.get(index)
        if reader is not None:
            reader.join(_PROGRESS_EOF_S)

    def wait(self, timeout: float | None = None) -> int:
        """Block until all workers exited (or one failed, or a PS died); returns the run's exit code.

        A node killed by a signal, with restarts left, is recovered from (a worker restarted alone,
        or the cluster rolled back; see the module docstring) and the wait goes on.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = list(self.workers)
        while pending:
            if self.elastic:
                pending += self._follow_wish()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            # the PS first: a worker whose PS died exits too (75, or with the error), but the PS is the cause
            child = wait_any(self.ps + pending, min(left, 1.0) if left is not None else 1.0)
            if child is not None and self._killed_after_done(child, pending):
                pending.remove(child)
                continue
            if child is not None and self._left(child):
                pending.remove(child)
                continue
            if child is not None and self._restartable_alone(child):
                pending[pending.index(child)] = self._restart_worker(child)
                continue
            if child is not None and self._recoverable(child) and self._restart_shard_alone(child):
                continue
            if child is not None and self._recoverable(child):
                self._roll_back(child)
                pending = list(self.workers)
                continue
            if child in self.ps:
                self._lines.write("run", f"{child.label} {_ended(child)}; stopping the run{self._advice(child)}")
                return _shell_code(_exit_code(child)) if _exit_code(child) < 0 else 1
            if child is not None:
                pending.remove(child)
                if child.poll() != 0:
                    why = f"{_ended(child)}; stopping the run{self._advice(child)}"
                    self._lines.write("run", f"{child.label} failed: {why}")
                    return _shell_code(_exit_code(child))
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"workers still running after {timeout}s")
        return 0

    def _follow_wish(self) -> list[Child]:
        """An elastic run: start or stop workers as a new scale wish asks; returns the workers started."""
        assert self.elastic is not None
        return [child for _, child in self.elastic.follow_wish(self.workers, self._start_slot, self._lines)]

    def _start_slot(self, slot: int) -> Child:
        """An elastic run's worker started in `slot` (a free one: never used, or its worker exited)."""
        if slot < len(self.workers):
            self._drain_progress(slot)
            self.board.restart(slot)  # the totals of the slot's earlier worker are kept
        return self._start_worker(slot)

    def _left(self, child: Child) -> bool:
        """An elastic run: a worker but the chief that left (asked to, or killed with no restart left);
        the others train on."""
        if self.elastic is None or child not in self.workers[1:]:
            return False
        code = child.poll()
        killed = code is not None and code < 0
        restart_left = killed and self._killed_with_restarts_left(child)
        slot = self.workers.index(child)
        return self.elastic.left(slot, child.label, _ended(child), killed, restart_left, self._lines)

    def _advice(self, child: Child) -> str:
        """What would have recovered from `child`, killed by a signal, when nothing did."""
        if _exit_code(child) >= 0:
            return ""
        if not self.options.checkpoint_dir and child not in self.workers[1:]:
            return " (with --checkpoint-dir the run rolls back to its latest checkpoint and goes on)"
        return f" (no restart left: --max-restarts {self.max_restarts})"

    def _killed_after_done(self, child: Child, pending: list[Child]) -> bool:
        """A worker killed by a signal after it reported that it finished its script: a success,
        unless it is worker 0 and others still run (they need the coordinator it hosted)."""
        code = child.poll()
        if code is None or code >= 0 or child not in self.workers:
            return False
        if child is self.workers[0] and any(other is not child for other in pending):
            return False
        index = self.workers.index(child)
        child.stop(1.0)  # what it left in its group; then its progress pipe ends
        self._drain_progress(index)
        if not self.board.is_done(index):
            return False
        self._lines.write("run", f"{child.label} was killed (signal {-code}) after it finished; not restarting it")
        return True

    def _killed_with_restarts_left(self, child: Child) -> bool:
        """Killed by a signal, a PS whose spill store failed (shard_restart.lost_shard), or a worker
        asking for the roll-back it learned of (RESTART_EXIT_CODE)."""
        code = child.poll()
        asked = code == RESTART_EXIT_CODE and child in self.workers
        lost = lost_shard(code) if child in self.ps else code is not None and code < 0
        return code is not None and (lost or asked) and self.restarts < self.max_restarts

    def _restartable_alone(self, child: Child) -> bool:
        # in every mode: a restarted worker joins the sync step under way (docs/consistency.md); one that
        # asked for a roll-back saw a PS or the chief restart: the whole cluster goes back
        return (
            self._killed_with_restarts_left(child) and child in self.workers[1:] and child.poll() != RESTART_EXIT_CODE
        )

    def _restart_worker(self, child: Child) -> Child:
        self.restarts += 1
        index = self.workers.index(child)
        self._lines.write(
            "run",
            f"{child.label} was killed (signal {-_exit_code(child)}); restarting it alone "
            f"(restart {self.restarts} of {self.max_restarts}); the others go on",
        )
        child.stop(1.0)
        self._drain_progress(index)  # its last lines count toward the totals it banks, not the new one's
        self.board.restart(index)
        self.workers[index] = self._start_worker(index)
        return self.workers[index]

    def _recoverable(self, child: Child) -> bool:
        return self._killed_with_restarts_left(child) and bool(self.options.checkpoint_dir)

    def _restart_shard_alone(self, child: Child) -> bool:
        """`recovery` "partial": start the killed PS `child` again alone from its newest checkpoint, on
        its address, and return True; False (saying why) when it cannot be: the caller rolls back."""
        why = why_not_alone(self.options, child in self.ps, child.poll())
        if why is not None:
            if why:
                self._lines.write("run", f"{child.label}: no partial recovery: {why}", event="partial_recovery_refused")
            return False
        self.restarts += 1
        index, address = self.ps.index(child), cast(str, self.ps_addresses[self.ps.index(child)])
        counted = f"{self.restarts} of {self.max_restarts}"
        line = restart_line(child.label, _exit_code(child), index, self.options, address, counted)
        self._lines.write("run", line, event="partial_recovery_started")
        child.stop(1.0)
        argv = self._node_argv("--role", "ps", "--index", str(index), "--bind", address)
        options = replace(self._node_options(ps_node_name(index)), resume=True)
        self.ps[index] = self._spawn(f"ps{index}", argv, self._env(options))
        return True

    def _roll_back(self, child: Child, timeout: float = 120.0) -> None:
        """Stop every node and start them all again from the latest complete checkpoint."""
        self.restarts += 1
        started = time.monotonic()
        code = _exit_code(child)
        why = how_lost(code)
        self._lines.write(
            "run",
            f"{child.label} {why}; rolling the whole cluster back "
            f"to the latest checkpoint in {self.options.checkpoint_dir} "
            f"(restart {self.restarts} of {self.max_restarts})",
            event="rollback_started",
        )
        stop_all(self.workers + self.ps, 2.0)
        for index in range(len(self.workers)):
            self._drain_progress(index)
        self.board.restart()
        self.ps, self.workers = [], []
        if self.elastic:
            self.elastic.leaving.clear()
        self.ps_addresses = [None] * self.num_ps
        self.options = replace(self.options, resume=True)
        self.start(timeout)
        took = time.monotonic() - started
        self._lines.write("run", f"cluster restarted in {took:.2f}s", event="rollback_done", duration_s=round(took, 3))

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every node at once (workers first), wait for all of them together, SIGKILL what is
        left after `grace` seconds (at least a PS's drain_grace_s, plus one: a PS still answering
        calls in flight is given the time it was promised); then join the launcher's threads (a few
        seconds at most)."""
        with self._nodes_lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
            nodes = self.workers + self.ps
            nodes += [child for child in self._spawned if child not in nodes and child.poll() is None]
        self.ready.fail(UnavailableError("the local cluster was stopped"))
        if self._run_files is not None:
            self._run_files.remove()
        self.wall_s = time.monotonic() - self._started_at if self._started_at else 0.0
        stop_all(nodes, max(grace, self.options.drain_grace_s + 1))
        deadline = time.monotonic() + _PROGRESS_EOF_S  # the nodes are gone: their pipes end now
        for thread in [self._watcher, *list(self._progress_readers.values())]:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))

    def interrupt(self) -> dict[str, Any]:
        """Freeze the progress board (steps taken from now on are not counted); returns its totals."""
        return self.board.freeze()

    def run(self, timeout: float = 120.0) -> int:
        """start + wait + stop, turning Ctrl-C into a clean stop (exit code 130); a run whose latest
        checkpoint failed ends with NO_CHECKPOINT (see `checkpoint_verdict`).

        With a checkpoint_dir the first Ctrl-C (or SIGTERM) lets the workers write a checkpoint at
        their next step first (`preempt`); a second one, even while the nodes stop, kills them at once."""
        try:
            try:
                self.start(timeout)
                code = self.wait()
                if code == 0:
                    self._let_evaluator_finish()
            except KeyboardInterrupt:
                self._interrupted()
                self.stop()
                return 130
            self.stop()
            if code == 0:
                self.warn_untrained()
        except KeyboardInterrupt:  # a second one: while the workers checkpoint, or while the nodes stop
            self._lines.write("run", "interrupted again: killing every node now")
            self.kill()
            return 130
        finally:
            self.stop()  # another error's way out (after the above: returns at once)
        return self.checkpoint_verdict(code)

    def _interrupted(self) -> None:
        """The first interrupt: with checkpoints, a checkpoint at the workers' next step; then the board
        is frozen (steps taken while the nodes stop are not counted)."""
        if self.options.checkpoint_dir and self.workers and self._started_at:
            self._lines.write(
                "run",
                f"interrupt: a checkpoint at the workers' next step, then every node stops "
                f"(within {self.options.preempt_grace_s:.0f}s; interrupt again to stop at once)",
                event="preemption",
            )
            self.preempt()
        totals = self.interrupt()
        self._lines.write(
            "run", f"interrupted at steps={totals['steps']:,} examples={totals['examples']:,}; stopping every node"
        )

    def preempt(self) -> None:
        """SIGTERM the workers alone (each checkpoints at its next step, worker/recovery/preemption.py) and wait
        for them, at most the preemption grace and a few seconds; the PS keep serving meanwhile."""
        workers = list(self.workers)
        for worker in workers:
            worker.terminate()
        deadline = time.monotonic() + self.options.preempt_grace_s + 5.0
        for worker in workers:
            worker.wait_until(deadline)
        for index in range(len(workers)):
            self._drain_progress(index)

    def kill(self) -> None:
        """SIGKILL every node started and reap it, at once (a second interrupt)."""
        if threading.current_thread() is threading.main_thread():  # a third Ctrl-C must not cut this short
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with self._nodes_lock:
            self._stopped.set()
            nodes = list(self._spawned)
        if self._run_files is not None:
            self._run_files.remove()
        for child in nodes:
            child.kill()
        for child in nodes:
            child.wait_until(time.monotonic() + 5.0)
        self.wall_s = self.wall_s or (time.monotonic() - self._started_at if self._started_at else 0.0)

    def warn_untrained(self) -> None:
        """Name the workers that trained no step while others did, or say that none did: the mark of a
        torch.optim optimizer, which trains a private copy on each worker. Call after `stop()`."""
        for index in range(len(self.workers)):
            self._drain_progress(index)
        steps = self.board.steps_by_worker()
        idle = [f"worker{i}" for i in range(self.num_workers) if not steps.get(i)]
        if len(idle) == self.num_workers:
            self._lines.write("run", f"no worker trained a step: {_PS_OPTIMIZERS}", event="no_steps")
        elif idle:
            self._lines.write(
                "run", f"{', '.join(idle)} trained no step while the others did: {_PS_OPTIMIZERS}", event="no_steps"
            )

    def _let_evaluator_finish(self, grace: float = EVALUATOR_GRACE_S) -> None:
        """Give the evaluator, which ends by itself after the final checkpoint, `grace` seconds to
        evaluate it; `stop` ends it after that. Its exit code is not the run's."""
        if self.evaluator is not None and self.evaluator.wait_until(time.monotonic() + grace) is None:
            self._lines.write("run", f"the evaluator did not end within {grace:.0f}s of training; stopping it")

    def checkpoint_verdict(self, code: int) -> int:
        """The run's exit code once its checkpoints are counted: NO_CHECKPOINT (and a line saying
        why) when it ended with 0 and a checkpoint directory but its chief's latest checkpoint failed
        (not written: it would not restore, or could not be stored), so that the run's newest
        progress is in no checkpoint; else `code`. A failure that a later written checkpoint made
        good (say one cut by a killed PS, before the roll-back) is counted in the closing line only.
        Call after `stop()`: every worker's progress lines are read first (their pipes end when the
        nodes are gone)."""
        if code != 0 or not self.options.checkpoint_dir:
            return code
        for index in range(len(self.workers)):
            self._drain_progress(index)
        chief = self.board.results.get(0, {})
        failed, written = chief.get("checkpoints_failed", 0), chief.get("checkpoints_written", 0)
        if not failed or (written and not chief.get("checkpoint_last_failed", True)):
            return code  # none failed (or the script never trained), or a later one was written
        self._lines.write(
            "run",
            f"the latest checkpoint to {self.options.checkpoint_dir} failed ({failed} failed, {written} written): "
            f"{chief.get('checkpoint_error', 'see the errors above')}; exiting with code {NO_CHECKPOINT}",
        )
        return NO_CHECKPOINT

    # ---- results ---------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """One JSON-able record of the run: totals, peak memory per role, and the workers' results
        (worker 0's win; the chief's checkpoint counts among them)."""
        extra: dict[str, Any] = {"peak_rss_mb": {role: round(rss / 2**20, 1) for role, rss in self.peak_rss.items()}}
        if self.elastic:
            extra["max_workers"] = self.elastic.max_workers
            extra["membership"] = self.elastic.events  # joins and leaves, seconds since the start
        return self.board.run_record(self.num_ps, self.num_workers, self.wall_s, **extra)

    # ---- internals -------------------------------------------------------------------------
    def _node_options(self, node: str) -> Options:
        """The options of node `node` ("ps-0", "worker-1"): its own certificate and token, when given,
        and the run's secret."""
        options = with_node_token(with_node_tls(self.options, self.certs, node), self.tokens, node)
        if self._run_files is None:
            return options
        return replace(options, run_secret_file=str(self._run_files.secret_path))

    def _node_argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "paramserver", "--log-level", self.log_level, "node", *args]

    def _env(self, options: Options, tf_config: str | None = None) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.update(threads.wait_policy_env(os.environ))  # idle OpenMP threads sleep (launch/threads.py)
        env[OPTIONS_ENV] = options.to_json()
        env.pop(TF_CONFIG_ENV, None)
        if tf_config:
            env[TF_CONFIG_ENV] = tf_config
        return env

    def _tf_config(self, worker: int) -> str:
        cluster = {"ps": self.ps_addresses, "worker": self.worker_addresses}
        return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": worker}})

    def _on_line(self, label: str, line: str) -> None:
        if line.startswith(READY_PREFIX):
            _, _, index, address = line.split()
            with self._ps_ready:
                self.ps_addresses[int(index)] = address
                self._ps_ready.notify_all()
            return
        self._lines.write(label, line)

    def _wait_ps_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._ps_ready:
            while None in self.ps_addresses:
                dead = [c.label for c in self.ps if c.poll() is not None]
                if dead or time.monotonic() > deadline:
                    why = f"{dead} exited" if dead else f"not ready within {timeout}s"
                    raise UnavailableError(f"parameter servers did not start: {why}")
                self._ps_ready.wait(0.1)

    def _read_progress(self, fd: int) -> None:
        with os.fdopen(fd) as stream:
            for line in stream:
                self.board.feed(line)

    def _watch(self) -> None:
        """Sample peak memory per role and print the progress line until stopped."""
        last_print = last_tree = 0.0
        tree: list[tuple[str, list[psutil.Process]]] = []
        tick = min(_MEMORY_EVERY_S, self.progress_every) if self.progress_every > 0 else _MEMORY_EVERY_S
        while not self._stopped.wait(tick):
            now = time.monotonic()
            if now - last_tree >= _TREE_EVERY_S:  # listing a node's children reads all of /proc: not each time
                tree, last_tree = self._process_tree(), now
            for role, processes in tree:
                self.peak_rss[role] = max(self.peak_rss[role], sum(_rss(p) for p in processes))
            if self.progress_every > 0 and now - last_print >= self.progress_every:
                last_print = now
                self._print_progress()

    def _process_tree(self) -> list[tuple[str, list[psutil.Process]]]:
        """(role, [node process, its children]) per running node: a node's loaders count toward it."""
        tree = []
        for role, children in (("ps", self.ps), ("worker", self.workers)):
            for child in list(children):
                try:
                    node = psutil.Process(child.pid)
                    tree.append((role, [node, *node.children(recursive=True)]))
                except psutil.Error:
                    continue
        return tree

    def _print_progress(self) -> None:
        t = self.board.totals()
        if t["steps"]:
            loss = f"{t['loss']:.4f}" if t["loss"] is not None else "-"
            running = ""
            if self.elastic:
                count = sum(child.poll() is None for child in list(self.workers))
                running = f" workers={count}/{self.elastic.max_workers}"
            self._lines.write(
                "run",
                f"steps={t['steps']:,} steps/s={t['recent_steps_per_s']:,.1f} "
                f"examples/s={t['recent_examples_per_s']:,.0f} loss={loss} "
                f"staleness={t['staleness_mean']:.2f}{running}",
            )


def _exit_code(child: Child) -> int:
    """The exit code of a child that has exited (negative: the signal that killed it)."""
    code = child.poll()
    if code is None:
        raise FailedPreconditionError(f"{child.label} is still running")
    return code


def _ended(child: Child) -> str:
    """How `child` ended, in words: "was killed (signal 9)" or "exited with code 1"."""
    code = _exit_code(child)
    return f"was killed (signal {-code})" if code < 0 else f"exited with code {code}"


def _shell_code(code: int) -> int:
    """A child's exit code as a shell reports it: 128 + the signal that killed it."""
    return 128 - code if code < 0 else code


def _rss(process: psutil.Process) -> int:
    try:
        return process.memory_info().rss
    except psutil.Error:  # exited meanwhile
        return 0
