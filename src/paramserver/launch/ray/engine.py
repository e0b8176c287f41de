"""A run on a Ray cluster: every PS and worker is a Ray actor (launch/ray/node_actor.py) that runs the node entry
as a child process on its Ray node; a placement group spreads them over the machines (launch/ray/placement.py).

As with `paramserver run`: the PS start first on their node's address, port 0, and announce it; then the
workers start with a TF_CONFIG naming those addresses and run the script. Output lines come back prefixed
("[ps0] ...", "[worker1] ..."), the workers' progress lines feed a ProgressBoard, a progress line sums them,
and the run ends with one closing JSON line (`summary`). Exit code: 0 when every worker succeeded, else the
first failing worker's (128 + signal for one killed by a signal), 1 for a PS that ended or a node lost that
nothing recovered.

Recovery (at most `max_restarts` times in all; the engine's, not Ray's: every actor has max_restarts=0, since a
node process lost with its actor must come back as part of a roll-back only the engine can drive):
- a worker other than the chief whose actor died (its Ray node lost) or whose node process was killed by a
  signal is started again in a new actor on whichever node has room; it rejoins as under the local launcher
  (it adopts the PS's values and resumes its data);
- a lost PS or chief (or a worker that asks for a roll-back), with a checkpoint_dir, makes the engine roll the
  whole cluster back as `paramserver run` does: every node process stops, every actor and the placement group
  go, and a new group places every node again (on the Ray nodes alive now) with `resume`: every shard and
  every worker's data position go back to the latest checkpoint. With recovery "partial" a lost PS is first
  restored alone (launch/ray/shard_restore.py) when it can be; without a checkpoint_dir the run ends.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import replace
from types import ModuleType
from typing import Any, TextIO

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError, UnavailableError
from paramserver.base.lifecycle import RESTART_EXIT_CODE
from paramserver.launch.local.processes import LineWriter
from paramserver.launch.local.shard_restart import lost_shard
from paramserver.launch.ray import node_actor, placement, shard_restore
from paramserver.launch.ray.nodes import Node, how, killed
from paramserver.launch.ray.scaling import Scaling
from paramserver.node.ps_process import READY_PREFIX
from paramserver.worker.progress import ProgressBoard

log = logging.getLogger(__name__)
_CALL_S = 60.0  # deadline of a short call to an actor (where, free_address); the first may wait for its process
_FOLLOW_S = 0.5  # how often `wait` looks at the nodes
_ROLL_BACK_GRACE_S = 2.0  # a roll-back: how long the node processes get to stop before SIGKILL
_PLACE_TRIES = 3  # a new worker's actor placed on a node that died meanwhile: how often it is placed again
_CAUSE_S = 5.0  # a worker asking for a roll-back: how long Ray may take to report the PS or chief it lost
_ALONE, _ROLLED_BACK = "alone", "rolled back"  # how a lost PS was recovered from
_FINISHED, _GOES_ON = "finished", "goes on"  # what a worker's end means for the run (else a roll-back or a code)


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
        self.ps: list[Node] = []
        self.workers: list[Node] = []
        self.ps_addresses: list[str | None] = [None] * num_ps
        self.worker_addresses: list[str] = []
        self._lines = LineWriter(out or sys.stdout, json_lines=options.log_format == "json")
        self._changed = threading.Condition()
        self._stopped = threading.Event()
        self._actor_class = ray.remote(node_actor.NodeRunner)
        self._group: Any = None
        self._timeout = 120.0
        self.scaling = Scaling(options.max_workers, num_workers, self._lines) if options.max_workers else None
        self._started_at = 0.0
        self.wall_s = 0.0

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        """Place every node, start the PS and wait for their addresses (at most `timeout` s), then the workers."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._started_at = self._started_at or time.monotonic()
        self._timeout = timeout
        roles = ["ps"] * self.num_ps + ["worker"] * (self.scaling.slots.wanted if self.scaling else self.num_workers)
        self._group = placement.spread_group(self.ray, [self.resources[role] for role in roles], timeout)
        actors = [
            self._new_actor(role, PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=bundle))
            for bundle, role in enumerate(roles)
        ]
        self.ps = [Node(f"ps{i}", "ps", i, actors[i]) for i in range(self.num_ps)]
        self.workers = [Node(f"worker{i}", "worker", i, a) for i, a in enumerate(actors[self.num_ps :])]
        self.ps_addresses = [None] * self.num_ps
        for node in self.ps:
            self._start_ps(node, f"{self._where(node)['ip']}:0")
        self._wait_ps_ready(timeout)
        self.worker_addresses = [self._call(node.actor.free_address) for node in self.workers]
        if self.scaling:
            self.scaling.slots.leaving.clear()
            self.scaling.publish({"ps": [a for a in self.ps_addresses if a], "worker": self.worker_addresses})
        for node in self.workers:
            self._start_worker(node)
        where = ", ".join(f"{n.label}@{n.where.get('ip')}/{n.where.get('node_id', '')[:8]}" for n in self.nodes())
        self._lines.write("run", f"on Ray: {where}")

    def wait(self) -> int:
        """Block until every worker ended (or one failed, or a PS ended); the run's exit code. A node lost (its
        actor or Ray node died, or its process killed by a signal) is recovered from as the docstring says."""
        pending = list(range(len(self.workers)))
        last_print = time.monotonic()
        while pending:
            if self.scaling:
                pending += [slot for slot in self.scaling.follow(self.workers, self._scale_up) if slot not in pending]
            with self._changed:
                self._changed.wait(_FOLLOW_S)
            if self.progress_every > 0 and time.monotonic() - last_print >= self.progress_every:
                last_print = time.monotonic()
                self._print_progress()
            dead_ps = next((node for node in self.ps if node.ended.is_set()), None)
            recovered = self._recover(dead_ps) if dead_ps is not None else None
            if recovered is not None:
                pending = pending if recovered == _ALONE else list(range(len(self.workers)))
                continue
            if dead_ps is not None:
                self._lines.write("run", f"{dead_ps.label} {how(dead_ps)}; stopping the run{self._advice(dead_ps)}")
                return 128 - dead_ps.code if dead_ps.code is not None and dead_ps.code < 0 else 1
            for index in [i for i in pending if self.workers[i].ended.is_set()]:
                verdict = self._worker_ended(self.workers[index])
                if verdict == _FINISHED:
                    pending.remove(index)
                elif verdict == _ROLLED_BACK:
                    pending = list(range(len(self.workers)))
                    break
                elif verdict != _GOES_ON:
                    return int(verdict)
        return 0

    def _worker_ended(self, node: Node) -> str | int:
        """What worker `node`'s end means: _FINISHED (it succeeded, or left an elastic run), _GOES_ON (restarted
        alone), _ROLLED_BACK, or the run's exit code (it failed, and nothing recovers it)."""
        index, was_killed = node.index, killed(node)
        restart_left = self.restarts < self.max_restarts
        if self.scaling and self.scaling.left(node, how(node), restart_left):
            self.ray.kill(node.actor)  # its resources go back to the Ray cluster
            return _FINISHED
        if node.code == 0 or (was_killed and self.board.is_done(index) and index > 0):
            return _FINISHED
        if was_killed and index > 0 and restart_left:
            self._restart(node)
            return _GOES_ON
        if self._rolls_back(node):
            self._roll_back(self._cause(node))
            return _ROLLED_BACK
        cause = self._cause(node)  # a worker that asked for a roll-back nothing drives: name what it lost
        failed = "" if cause.role == "ps" else " failed:"
        self._lines.write("run", f"{cause.label}{failed} {how(cause)}; stopping the run{self._advice(cause)}")
        if cause.code is not None and cause.code < 0:
            return 128 - cause.code
        return 1 if cause.role == "ps" else cause.code or 1

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every node process (workers first), SIGKILL what is left after `grace` s (at least a PS's drain
        grace plus one), end the actors and the placement group. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.wall_s = time.monotonic() - self._started_at if self._started_at else 0.0
        if self.scaling:
            self.scaling.remove()
        self._stop_nodes(max(grace, self.options.drain_grace_s + 1))

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

    def nodes(self) -> list[Node]:
        return self.ps + self.workers

    # ---- results ---------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """One JSON-able record of the run, as the local launcher's: totals, the workers' results (worker 0's win)."""
        extra: dict[str, Any] = {"restarts": self.restarts}
        if self.scaling:
            extra.update(self.scaling.record())
        record = self.board.run_record(self.num_ps, self.num_workers, self.wall_s, **extra)
        return {"engine": "ray", **record}

    # ---- recovery --------------------------------------------------------------------------
    def _recover(self, node: Node) -> str | None:
        """PS `node` ended: restore its shard alone (_ALONE) or roll the cluster back (_ROLLED_BACK), when it was
        lost (not stopped on purpose), a checkpoint_dir is set and restarts are left; None: nothing recovers it."""
        lost = bool(node.lost) or lost_shard(node.code)
        if not (lost and self.options.checkpoint_dir and self.restarts < self.max_restarts):
            return None
        if self._restore_shard_alone(node):
            return _ALONE
        self._roll_back(node)
        return _ROLLED_BACK

    def _rolls_back(self, node: Node) -> bool:
        """Worker `node` ended so that the cluster rolls back: the chief lost, or any worker asking for it."""
        asked = node.code == RESTART_EXIT_CODE
        lost = killed(node) and node.index == 0
        return (asked or lost) and bool(self.options.checkpoint_dir) and self.restarts < self.max_restarts

    def _cause(self, node: Node) -> Node:
        """The node a roll-back is for. A worker asking for one (RESTART_EXIT_CODE) lost a PS or the chief, whose
        actor's death Ray may report a moment later (its health checks): that node, once reported (at most
        _CAUSE_S s); else `node`."""
        deadline = time.monotonic() + (_CAUSE_S if node.code == RESTART_EXIT_CODE else 0.0)
        while True:
            lost = [n for n in self.ps + self.workers[:1] if n.ended.is_set() and (n.role == "ps" or killed(n))]
            if lost or time.monotonic() >= deadline:
                return lost[0] if lost else node
            with self._changed:
                self._changed.wait(0.1)

    def _restore_shard_alone(self, node: Node) -> bool:
        """`recovery` "partial": PS `node` started again alone from its newest checkpoint on its address, when
        shard_restore says it can be (saying why not otherwise: the caller rolls back)."""
        address = self.ps_addresses[node.index] or ""
        plan = shard_restore.plan(self.options, node.code, bool(node.lost))
        if plan.refused is not None:
            if plan.refused:
                self._lines.write("run", f"{node.label}: no partial recovery: {plan.refused}")
            return False
        self.ray.kill(node.actor)  # its resources go back to its Ray node, which the new actor may take
        fresh = Node(node.label, "ps", node.index, self._new_actor("ps", plan.strategy(self._group, node.index)))
        self.ps[node.index] = fresh  # a roll-back now stops it with the others
        try:
            refused = shard_restore.refusal_on(address, self._where(fresh))
        except self.ray.exceptions.GetTimeoutError:
            refused = f"no Ray node had room for it within {_CALL_S:.0f}s"
        if refused:
            self._lines.write("run", f"{node.label}: no partial recovery: {refused}")
            return False
        self.restarts += 1
        counted = f"{self.restarts} of {self.max_restarts}"
        on = f"{address} (Ray node {fresh.where.get('node_id', '')[:8]})"
        self._lines.write("run", shard_restore.line(node.label, how(node), node.index, self.options, on, counted))
        self._start_ps(fresh, address, resume=True)
        return True

    def _roll_back(self, node: Node) -> None:
        """Stop every node, place them all again and start them from the latest complete checkpoint."""
        self.restarts += 1
        started = time.monotonic()
        self._lines.write(
            "run",
            f"{node.label} {how(node)}; rolling the whole cluster back to the latest checkpoint in "
            f"{self.options.checkpoint_dir} (restart {self.restarts} of {self.max_restarts})",
            event="rollback_started",
        )
        self._stop_nodes(_ROLL_BACK_GRACE_S)
        self.board.restart()  # the steps since the checkpoint are trained again
        self.options = replace(self.options, resume=True)
        try:
            self.start(self._timeout)
        except self.ray.exceptions.RayActorError as exc:  # placed on a Ray node that died meanwhile: once more
            self._lines.write("run", f"a node was placed on a Ray node that died ({type(exc).__name__}); again")
            self._stop_nodes(_ROLL_BACK_GRACE_S)
            time.sleep(1.0)  # time for Ray to mark the node dead
            self.start(self._timeout)
        took = time.monotonic() - started
        self._lines.write("run", f"cluster restarted in {took:.2f}s", event="rollback_done", duration_s=round(took, 3))

    def _advice(self, node: Node) -> str:
        """What would have recovered from `node`, lost, when nothing did."""
        if not killed(node) or (node.role == "worker" and node.index > 0):
            return ""
        if not self.options.checkpoint_dir:
            return " (with a checkpoint_dir the run rolls back to its latest checkpoint and goes on)"
        return f" (no restart left: max_restarts {self.max_restarts})"

    # ---- internals -------------------------------------------------------------------------
    def _new_actor(self, role: str, strategy: Any) -> Any:
        options = placement.actor_options(self.resources[role])
        return self._actor_class.options(
            scheduling_strategy=strategy, max_concurrency=4, max_restarts=0, **options
        ).remote()

    def _call(self, method: Any) -> Any:
        return self.ray.get(method.remote(), timeout=_CALL_S)

    def _where(self, node: Node) -> dict[str, str]:
        if not node.where:
            node.where = self._call(node.actor.where)
        return node.where

    def _stop_nodes(self, grace: float) -> None:
        """Stop every node process (SIGTERM, SIGKILL after `grace` s), join the followers (their last progress
        lines fed), end the actors and the placement group."""
        nodes = self.workers + self.ps
        calls = [node.actor.stop.remote(grace) for node in nodes if not node.ended.is_set()]
        if calls:
            self.ray.wait(calls, num_returns=len(calls), timeout=grace + 10)
        deadline = time.monotonic() + 5.0
        for node in nodes:
            if node.follower is not None:
                node.follower.join(max(0.0, deadline - time.monotonic()))
            if node.actor is not None:  # None: a worker that found no room (_scale_up)
                self.ray.kill(node.actor)
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)
            self._group = None

    def _start_ps(self, node: Node, bind: str, resume: bool = False) -> None:
        options = replace(self.options, resume=True) if resume else self.options
        self._follow(node, ["--role", "ps", "--index", str(node.index), "--bind", bind], None, options)

    def _start_worker(self, node: Node) -> None:
        self._where(node)
        config = {"cluster": {"ps": self.ps_addresses, "worker": self.worker_addresses}}
        tf_config = json.dumps({**config, "task": {"type": "worker", "index": node.index}})
        self._follow(node, [self.script, *self.args], tf_config, self.options)
        if self.scaling:
            self.scaling.slots.record(node.index, "started")

    def _restart(self, node: Node) -> None:
        """A new actor for worker `node` on whichever node has room; it rejoins the run."""
        self.restarts += 1
        self._lines.write(
            "run",
            f"{node.label} {how(node)}; restarting it alone (restart {self.restarts} of {self.max_restarts}); "
            f"the others go on",
        )
        self.ray.kill(node.actor)
        self.workers[node.index] = self._start_slot(node.index)

    def _start_slot(self, slot: int) -> Node:
        """Worker `slot` in a new actor on whichever Ray node has room (one that joined since the start included);
        a slot used before keeps its earlier workers' totals on the board."""
        if slot < len(self.workers):
            self.board.restart(slot)  # its follower ended: every line it read was fed
        node, address = self._placed_worker(slot)
        # slots are taken lowest first; one below it left empty (its worker found no room) is listed, unused
        self.worker_addresses += [address] * (slot + 1 - len(self.worker_addresses))
        self.worker_addresses[slot] = address
        self._start_worker(node)
        self._lines.write("run", f"{node.label} on Ray: {node.where.get('ip')}/{node.where.get('node_id', '')[:8]}")
        return node

    def _placed_worker(self, slot: int) -> tuple[Node, str]:
        """A new actor for worker `slot` that Ray placed on a live node with room, and a free address there. An
        actor placed on a node that died meanwhile (Ray may place it before it marked the node dead) is placed
        again, up to _PLACE_TRIES times; UnavailableError when no node has room within _CALL_S s."""
        attempt = 1
        while True:
            node = Node(f"worker{slot}", "worker", slot, self._new_actor("worker", "SPREAD"))
            try:
                return node, self._call(node.actor.free_address)  # Ray queues an actor until a node has room
            except self.ray.exceptions.GetTimeoutError:
                self.ray.kill(node.actor)
                why = f"no Ray node had room for {node.label} ({self.resources['worker']}) within {_CALL_S:.0f}s"
                raise UnavailableError(why) from None
            except self.ray.exceptions.RayActorError as exc:
                if attempt == _PLACE_TRIES:
                    raise UnavailableError(f"{node.label} could not be placed on a live Ray node: {exc}") from None
                log.info("%s was placed on a Ray node that died (%s); placing it again", node.label, exc)
                attempt += 1
                time.sleep(1.0)  # time for Ray to mark the node dead

    def _scale_up(self, slot: int) -> Node:
        """`paramserver scale`'s new worker in `slot`. One that finds no room on the Ray cluster is dropped, saying
        so: it counts as ended at once, its slot free for a later wish (the run goes on as it was)."""
        try:
            return self._start_slot(slot)
        except UnavailableError as exc:
            self._lines.write("run", f"{exc}: not started; scale again once the Ray cluster has room")
            dropped = Node(f"worker{slot}", "worker", slot, None, code=0)
            dropped.ended.set()
            return dropped

    def _follow(self, node: Node, node_args: list[str], tf_config: str | None, options: Options) -> None:
        """Start the node process in its actor and follow its stream on a thread of its own."""
        env = {"PARAMSERVER_OPTIONS": options.to_json()}
        if tf_config:
            env["TF_CONFIG"] = tf_config
        argv = ["--log-level", self.log_level, "node", *node_args]
        stream = node.actor.run.remote(argv, env, node.role == "worker")
        node.follower = threading.Thread(target=self._read, args=(node, stream), name=f"ray-{node.label}", daemon=True)
        node.follower.start()

    def _read(self, node: Node, stream: Any) -> None:
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

    def _print_progress(self) -> None:
        t = self.board.totals()
        if t["steps"]:
            loss = f"{t['loss']:.4f}" if t["loss"] is not None else "-"
            scaling = self.scaling
            running = f" workers={scaling.running(self.workers)}/{scaling.max_workers}" if scaling else ""
            self._lines.write(
                "run",
                f"steps={t['steps']:,} steps/s={t['recent_steps_per_s']:,.1f} "
                f"examples/s={t['recent_examples_per_s']:,.0f} loss={loss} staleness={t['staleness_mean']:.2f}"
                f"{running}",
            )
