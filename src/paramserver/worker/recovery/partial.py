"""Partial recovery (`recovery` "partial"): a killed PS restores its own shard, the rest goes on.

With the default, "rollback", a PS that dies sends the whole cluster back to its latest checkpoint
(worker/recovery/rollback.py, launch/local/supervisor.py). With "partial", only the lost shard goes back: its new
process restores the shard from its newest checkpoint chain (`resume`), while the other shards
keep their state and every worker keeps its data position. A worker whose step finds the shard
gone (unreachable, or a new process that refuses its pushes) waits for it to come back, registers
with it again (the shard keeps its restored values; the worker adopts them), and trains on from
its next batch: no step is trained twice. The shard lost exactly the updates it took after its
checkpoint; each worker logs how many of its steps that is and reports it to the launcher
(`partial_recoveries` in the closing line).

Partial recovery needs async mode (a sync step or an ssp clock restored alone would be behind the
other shards'), a checkpoint directory and a complete checkpoint; the loss of the chief (it hosts
the coordinator) or of a worker is handled as before. `refusal` says why partial recovery cannot
be used; the launcher then rolls the whole cluster back and logs why. A shard that comes back
with no checkpoint to restore from (under a restart loop, before the first checkpoint) makes the
worker flag a roll-back (RollbackError), the way `recovery` "rollback" would have.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any, NoReturn

from paramserver.base.config import Options
from paramserver.base.deadline import Deadline
from paramserver.base.errors import ParamServerError, RollbackError, UnavailableError
from paramserver.client.ps_client import hello
from paramserver.transport.channel import ShardChannel

log = logging.getLogger(__name__)
_PORT_TRY_S = 0.5  # one attempt to open a TCP connection to the shard's address
_HELLO_S = 10.0  # once its port accepts: how long its new process may take to answer Hello, at most
_RETRY_PAUSE_S = 0.05  # between attempts (a process restarting); the deadline is the verdict


def refusal(options: Options, is_ps: bool, checkpoints: list[str]) -> str | None:
    """Why a node's loss cannot be recovered from by restoring its shard alone, or None when it can.
    `is_ps`: the node lost is a PS (else the chief); `checkpoints`: the complete checkpoints there are."""
    if options.recovery != "partial":
        return "recovery is 'rollback'"
    if not is_ps:
        return "the chief hosts the coordinator (membership, barriers): its loss rolls the whole cluster back"
    if not options.checkpoint_dir:
        return "no checkpoint_dir to restore the shard from"
    if options.mode != "async" or options.mode_schedule:
        mode = options.mode + (" with a mode schedule" if options.mode_schedule else "")
        return (
            f"partial recovery needs async mode, not {mode}: a shard's steps restored alone would be behind the others'"
        )
    if not checkpoints:
        return f"no complete checkpoint in {options.checkpoint_dir} yet"
    return None


def supported(options: Options) -> bool:
    """Whether a worker recovers lost shards itself (the chief's coordinator then flags no roll-back for them)."""
    return refusal(options, True, ["any"]) is None


class ShardRecovery:
    """A worker's side of partial recovery. Used from the training thread (and the chief's
    checkpoint, which runs in it): `recover(shard, step, cause)` when a step found `shard` gone;
    `before_checkpoint(timeout)` brings back shards that restarted before the chief writes."""

    def __init__(self, context: Any, make_channel: Callable[[int], ShardChannel], wait_s: float) -> None:
        """`make_channel(shard)`: a new channel to the shard's address (not yet ready); `wait_s`: how long
        a shard may stay away (its process restarting and restoring) before the cluster rolls back."""
        self.context = context
        self.make_channel = make_channel
        self.wait_s = wait_s

    def recover(self, shard: int, step: int, cause: ParamServerError) -> int:
        """Wait for `shard`'s new process, register with it again and load its values; returns the steps
        of this worker it lost (`step`: this worker's steps pushed, the failed one included). Raises
        `cause` when the shard is the same process (not a restart), RollbackError when it cannot come back."""
        ctx, started = self.context, time.monotonic()
        old = ctx.client.incarnations[shard]
        log.warning("ps %d is gone (%s): waiting for it to restore its shard (partial recovery)", shard, cause)
        channel = self._wait_back(shard, old, cause)
        restored_from = (getattr(channel, "hello", None) or {}).get("restored_from")
        if restored_from is None:
            channel.close()
            self._roll_back(f"ps {shard} came back with no checkpoint to restore its shard from")
        ctx.client.replace_channel(shard, channel)
        table_position = 0  # a model of tables only learns the shard's count of its steps from RegisterTable
        if "tables" in ctx.__dict__:  # the TableClient exists (cached_property): it has tables to restore
            ctx.tables.replace_channel(shard, channel)
            table_position = ctx.tables.register_again(shard, ctx.options.rpc_timeout_s)
        position = max(table_position, ctx.client.register_again(shard, ctx.options.rpc_timeout_s, self._load))
        lost, took = max(0, step - position), time.monotonic() - started
        log.warning(
            "ps %d is back, restored from %s after %.2fs: its shard lost %d step(s) of worker %d%s; training goes on",
            shard,
            restored_from,
            took,
            lost,
            ctx.worker_index,
            f" (steps {position + 1}-{step})" if lost else "",
            extra={"event": "partial_recovery", "step": step, "duration_s": round(took, 3)},
        )
        incarnation = (getattr(channel, "hello", None) or {}).get("incarnation")
        ctx.progress.lost(shard, str(incarnation), lost, restored_from, took)
        return lost

    def before_checkpoint(self, timeout: float) -> None:
        """The chief, before the shards write: a shard that restarted since this worker registered
        with it is registered with again (so it holds its restored state), one that is down is waited for."""
        self.bring_back()

    def after_failed_lookup(self, cause: ParamServerError) -> None:
        """A lookup outside a step failed with `cause`: bring back the shards that are gone (the lookup
        is then sent again), or raise `cause` when none is."""
        if not self.bring_back():
            raise cause

    def bring_back(self) -> bool:
        """Recover every shard that is down or restarted since this worker registered with it; returns
        whether there was one."""
        ctx, found = self.context, False
        steps = max((optimizer.steps for optimizer in ctx.optimizers), default=0)
        for shard, channel in enumerate(ctx.client.channels):
            cause: ParamServerError = UnavailableError(f"ps {shard} restarted")
            try:
                gone = hello(channel).get("incarnation") != ctx.client.incarnations[shard]
            except ParamServerError as exc:
                gone, cause = True, exc
            if gone:
                self.recover(shard, steps, cause)
                found = True
        return found

    def _wait_back(self, shard: int, old: str | None, cause: ParamServerError) -> ShardChannel:
        """A ready channel to `shard`'s new process (its Hello names another incarnation than `old`)."""
        deadline = Deadline(self.wait_s)
        while True:
            channel = self.make_channel(shard) if _accepts(channel_address(self.context, shard)) else None
            try:
                if channel is None:
                    raise UnavailableError(f"ps {shard} does not accept connections")
                channel.wait_ready(max(0.1, min(_HELLO_S, deadline.left())))
            except ParamServerError:
                if channel is not None:
                    channel.close()
                if deadline.left() <= 0:
                    self._roll_back(f"ps {shard} did not come back within {self.wait_s:.0f}s")
                time.sleep(_RETRY_PAUSE_S)
                continue
            if (getattr(channel, "hello", None) or {}).get("incarnation") == old:
                channel.close()
                raise cause  # the same process answers: the call failed for another reason
            return channel

    def _roll_back(self, why: str) -> NoReturn:
        reason = f"{why}: partial recovery impossible, the cluster rolls back"
        if self.context.rollback is not None:
            self.context.rollback.flag(reason)
        raise RollbackError(reason)

    def _load(self, values: list) -> None:
        for optimizer in self.context.optimizers:
            optimizer.load_parts(values)


def channel_address(context: Any, shard: int) -> str:
    """The address ("host:port") of `shard`, as this worker's channel to it names it."""
    return str(getattr(context.client.channels[shard], "address", ""))


def _accepts(address: str) -> bool:
    """Whether a TCP connection to `address` opens now (a new channel's gRPC would otherwise back off
    for a second or more after a refused connection, while the process restarts)."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return True  # not host:port: let the channel try
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_PORT_TRY_S):
            return True
    except OSError:
        return False
