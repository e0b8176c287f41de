"""`paramserver run --recovery partial`: a killed PS is started again alone, on its own address, from
its newest checkpoint (`resume`); the other PS and every worker go on (worker/recovery/partial.py). When that
cannot be (worker/recovery/partial.py, `refusal`: the chief lost, no complete checkpoint yet, a mode other
than async), the launcher says why and rolls the whole cluster back as with `--recovery rollback`.
A PS that exits with SPILL_FAILED_EXIT_CODE (its spill store failed: node/ps_process.py) lost its
shard's state as a killed one did, and is recovered from the same way (`lost_shard`).
"""

from __future__ import annotations

from paramserver.base.config import Options
from paramserver.base.lifecycle import RESTART_EXIT_CODE
from paramserver.checkpoint.store import CheckpointError, CheckpointStore
from paramserver.node.ps_process import SPILL_FAILED_EXIT_CODE
from paramserver.worker.recovery.partial import refusal


def lost_shard(code: int | None) -> bool:
    """Whether a PS that ended with `code` lost its shard's state and is recovered from (a signal
    killed it, or its spill store failed), rather than stopped on purpose."""
    return code is not None and (code < 0 or code == SPILL_FAILED_EXIT_CODE)


def how_lost(code: int) -> str:
    """How a node lost its state, in words: "was killed (signal 9)", "lost its spill store (exit 74)"."""
    if code == RESTART_EXIT_CODE:
        return "asked for a roll-back"
    if code == SPILL_FAILED_EXIT_CODE:
        return f"lost its spill store (exit {code})"
    return f"was killed (signal {-code})" if code < 0 else f"exited with code {code}"


def complete_checkpoints(directory: str) -> list[str]:
    """The complete checkpoints in `directory` (none when it cannot be read)."""
    try:
        return CheckpointStore(directory).complete()
    except (CheckpointError, OSError):
        return []


def why_not_alone(options: Options, is_ps: bool, code: int | None) -> str | None:
    """None when the node lost (a PS when `is_ps`, else the chief; `code`: its exit code) is recovered
    from by restarting its shard alone; else why not ("" with recovery "rollback": nothing to say)."""
    if options.recovery != "partial":
        return ""
    if code == RESTART_EXIT_CODE:
        return "a worker asked for the roll-back (its partial recovery could not be)"
    return refusal(options, is_ps, complete_checkpoints(options.checkpoint_dir) if is_ps else [])


def restart_line(label: str, code: int, shard: int, options: Options, address: str, restarts: str) -> str:
    """The launcher's line when it restores shard `shard` alone."""
    return (
        f"{label} {how_lost(code)}; restoring shard {shard} alone from its newest checkpoint in "
        f"{options.checkpoint_dir}, on {address}; the other shards and the workers go on (partial recovery, "
        f"restart {restarts})"
    )
