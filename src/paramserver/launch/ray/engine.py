"""A run on a Ray cluster: every PS and worker is a Ray actor (launch/ray/node_actor.py) that runs the node entry
as a child process on its Ray node; a placement group spreads them over the machines (launch/ray/placement.py).

As with `paramserver run`: the PS start first on their node's address, port 0, and announce it; then the
workers start with a TF_CONFIG naming those addresses and run the script. Output lines come back prefixed
("[ps0] ...", "[worker1] ..."), the workers' progress lines feed a ProgressBoard, a progress line sums them,
and the run ends with one closing JSON line (`summary`). Exit code: 0 when every worker succeeded, else the
first failing worker's (128 + signal for one killed by a signal), 1 for a PS that ended or a node lost that
nothing recovered.

Recovery: a worker other than the chief whose actor died (its Ray node lost) or whose node process was killed
by a signal is started again in a new actor on whichever node has room, at most `max_restarts` times in all;
it rejoins as under the local launcher (it adopts the PS's values and resumes its data). A lost PS or chief
ends the run (roll-backs are the local launcher's and Kubernetes'; not done here).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TextIO

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError, UnavailableError
from paramserver.launch.local.processes import LineWriter
from paramserver.launch.ray import node_actor, placement
from paramserver.node.ps_process import READY_PREFIX
from paramserver.worker.progress import ProgressBoard

log = logging.getLogger(__name__)
_CALL_S = 60.0  # deadline of a short call to an actor (where, free_address); the first may wait for its process
_FOLLOW_S = 0.5  # how often `wait` looks at the nodes


@dataclass
class _Node:
    """One node of the run: its actor, and how its node process ended (set by its follower thread)."""

    label: str
    role: str
    index: int
    actor: Any
    where: dict[str, str] = field(default_factory=dict)
    code: int | None = None  # the node process's exit code (negative: the signal), once it ended
    lost: str = ""  # why the actor died (its Ray node lost), when it did
    ended: threading.Event = field(default_factory=threading.Event)
    follower: threading.Thread | None = None


class RayCluster:
    """N PS and M workers as Ray actors running one script (see the module docstring).

    Call order: `run()` (start, wait, stop), or `start(timeout)`, `wait()`, `stop()`; `summary()` after.
    `stop` is idempotent and may be called from another thread; the rest from the driving thread.
    """

    def __init__(
        self,
        ray: ModuleType,
        script: str,
        args: list[str],
        num_ps: int,
        num_workers: int,
        options: Options,
        resources: dict[str, dict[str, float]],
        out: TextIO | None = None,
        progress_every: float = 2.0,
        log_level: str = "INFO",
        max_restarts: int = 3,
    ) -> None:
        if num_ps < 1 or num_workers < 1:
            raise ConfigError(f"need at least 1 PS and 1 worker, got ps={num_ps} workers={num_workers}")
        self.ray, self.script, self.args = ray, script, list(args)
        self.num_ps, self.num_workers = num_ps, num_workers
        self.options, self.resources = options, resources
        self.progress_every, self.log_level, self.max_restarts = progress_every, log_level, max_restarts
        self.restarts = 0
        self.board = ProgressBoard()
        self.ps: list[_Node] = []
        self.workers: list[_Node] = []
        self.ps_addresses: list[str | None] = [None] * num_ps
        self.worker_addresses: list[str] = []
        self._lines = LineWriter(out or sys.stdout, json_lines=options.log_format == "json")
        self._changed = threading.Condition()
        self._stopped = threading.Event()
        self._actor_class = ray.remote(node_actor.NodeRunner)
        self._group: Any = None
        self._started_at = 0.0
        self.wall_s = 0.0

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        """Place every node, start the PS and wait for their addresses (at most `timeout` s), then the workers."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._started_at = time.monotonic()
        roles = ["ps"] * self.num_ps + ["worker"] * self.num_workers
        self._group = placement.spread_group(self.ray, [self.resources[role] for role in roles], timeout)
        actors = [
            self._new_actor(role, PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=bundle))
            for bundle, role in enumerate(roles)
        ]
        self.ps = [_Node(f"ps{i}", "ps", i, actors[i]) for i in range(self.num_ps)]
        self.workers = [_Node(f"worker{i}", "worker", i, actors[self.num_ps + i]) for i in range(self.num_workers)]
        for node in self.ps:
            node.where = self._call(node.actor.where)
            self._follow(node, ["--role", "ps", "--index", str(node.index), "--bind", f"{node.where['ip']}:0"], None)
        self._wait_ps_ready(timeout)
        self.worker_addresses = [self._call(node.actor.free_address) for node in self.workers]
        for node in self.workers:
            self._start_worker(node)
        where = ", ".join(f"{n.label}@{n.where.get('ip')}/{n.where.get('node_id', '')[:8]}" for n in self.nodes())
        self._lines.write("run", f"on Ray: {where}")

    def wait(self) -> int:
        """Block until every worker ended (or one failed, or a PS ended); the run's exit code. A worker lost
        (its actor or Ray node died, or its process killed by a signal) is restarted as the docstring says."""
        pending = list(range(self.num_workers))
        last_print = time.monotonic()
        while pending:
            with self._changed:
                self._changed.wait(_FOLLOW_S)
            if self.progress_every > 0 and time.monotonic() - last_print >= self.progress_every:
                last_print = time.monotonic()
                self._print_progress()
            dead_ps = next((node for node in self.ps if node.ended.is_set()), None)
            if dead_ps is not None:
                self._lines.write("run", f"{dead_ps.label} {_how(dead_ps)}; stopping the run")
                return 1
            for index in [i for i in pending if self.workers[i].ended.is_set()]:
                node = self.workers[index]
                if node.code == 0 or (self._killed(node) and self.board.is_done(index) and index > 0):
                    pending.remove(index)
                elif self._killed(node) and index > 0 and self.restarts < self.max_restarts:
                    self._restart(node)
                else:
                    self._lines.write("run", f"{node.label} failed: {_how(node)}; stopping the run")
                    return 128 - node.code if node.code is not None and node.code < 0 else node.code or 1
        return 0

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every node process (workers first), SIGKILL what is left after `grace` s (at least a PS's drain
        grace plus one), end the actors and the placement group. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.wall_s = time.monotonic() - self._started_at if self._started_at else 0.0
        grace = max(grace, self.options.drain_grace_s + 1)
        nodes = self.workers + self.ps
        calls = [node.actor.stop.remote(grace) for node in nodes if not node.ended.is_set()]
        if calls:
            self.ray.wait(calls, num_returns=len(calls), timeout=grace + 10)
        deadline = time.monotonic() + 5.0
        for node in nodes:
            if node.follower is not None:
                node.follower.join(max(0.0, deadline - time.monotonic()))
            self.ray.kill(node.actor)
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)

    def run(self, timeout: float = 120.0) -> int:
        """start + wait + stop; Ctrl-C stops every node (exit code 130, the board frozen first)."""
        try:
            self.start(timeout)
            return self.wait()
        except KeyboardInterrupt:
            totals = self.board.freeze()
            self._lines.write("run", f"interrupted at steps={totals['steps']:,}; stopping every node")
            return 130
        finally:
            self.stop()

    def nodes(self) -> list[_Node]:
        return self.ps + self.workers

    # ---- results ---------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """One JSON-able record of the run, as the local launcher's: totals, the workers' results (worker 0's win)."""
        record = self.board.run_record(self.num_ps, self.num_workers, self.wall_s, restarts=self.restarts)
        return {"engine": "ray", **record}

    # ---- internals -------------------------------------------------------------------------
    def _new_actor(self, role: str, strategy: Any) -> Any:
        options = placement.actor_options(self.resources[role])
        return self._actor_class.options(
            scheduling_strategy=strategy, max_concurrency=4, max_restarts=0, **options
        ).remote()

    def _call(self, method: Any) -> Any:
        return self.ray.get(method.remote(), timeout=_CALL_S)

    def _start_worker(self, node: _Node) -> None:
        if not node.where:
            node.where = self._call(node.actor.where)
        config = {"cluster": {"ps": self.ps_addresses, "worker": self.worker_addresses}}
        tf_config = json.dumps({**config, "task": {"type": "worker", "index": node.index}})
        self._follow(node, [self.script, *self.args], tf_config)

    def _restart(self, node: _Node) -> None:
        """A new actor for worker `node` on whichever node has room; it rejoins the run."""
        self.restarts += 1
        self._lines.write(
            "run",
            f"{node.label} {_how(node)}; restarting it alone (restart {self.restarts} of {self.max_restarts}); "
            f"the others go on",
        )
        self.ray.kill(node.actor)
        self.board.restart(node.index)  # its follower ended: every line it read was fed
        fresh = _Node(node.label, "worker", node.index, self._new_actor("worker", "SPREAD"))
        self.workers[node.index] = fresh
        self.worker_addresses[node.index] = self._call(fresh.actor.free_address)
        self._start_worker(fresh)

    def _follow(self, node: _Node, node_args: list[str], tf_config: str | None) -> None:
        """Start the node process in its actor and follow its stream on a thread of its own."""
        env = {"PARAMSERVER_OPTIONS": self.options.to_json()}
        if tf_config:
            env["TF_CONFIG"] = tf_config
        argv = ["--log-level", self.log_level, "node", *node_args]
        stream = node.actor.run.remote(argv, env, node.role == "worker")
        node.follower = threading.Thread(target=self._read, args=(node, stream), name=f"ray-{node.label}", daemon=True)
        node.follower.start()

    def _read(self, node: _Node, stream: Any) -> None:
        """The follower thread: every record of `node`'s stream, until it exited or its actor died."""
        try:
            for ref in stream:
                kind, text = self.ray.get(ref, timeout=_CALL_S)
                if kind == node_actor.EXIT:
                    node.code = int(text)
                elif kind == node_actor.PROGRESS:
                    self.board.feed(text)
                elif text.startswith(READY_PREFIX) and node.role == "ps":
                    self.ps_addresses[node.index] = text.split()[3]
                else:
                    self._lines.write(node.label, text)
        except self.ray.exceptions.RayError as exc:
            node.lost = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            node.ended.set()
            with self._changed:
                self._changed.notify_all()

    def _wait_ps_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while None in self.ps_addresses:
            dead = [node.label for node in self.ps if node.ended.is_set()]
            if dead or time.monotonic() > deadline:
                why = f"{dead} ended" if dead else f"not ready within {timeout}s"
                raise UnavailableError(f"parameter servers did not start: {why}")
            with self._changed:
                self._changed.wait(0.1)

    def _killed(self, node: _Node) -> bool:
        """Its actor died (its Ray node lost) or its process was killed by a signal."""
        return bool(node.lost) or (node.code is not None and node.code < 0)

    def _print_progress(self) -> None:
        t = self.board.totals()
        if t["steps"]:
            loss = f"{t['loss']:.4f}" if t["loss"] is not None else "-"
            self._lines.write(
                "run",
                f"steps={t['steps']:,} steps/s={t['recent_steps_per_s']:,.1f} "
                f"examples/s={t['recent_examples_per_s']:,.0f} loss={loss} staleness={t['staleness_mean']:.2f}",
            )


def _how(node: _Node) -> str:
    """How a node ended, in words."""
    if node.lost:
        return f"was lost with its Ray actor ({node.lost})"
    if node.code is not None and node.code < 0:
        return f"was killed (signal {-node.code})"
    return f"exited with code {node.code}"
