"""`paramserver run --recovery partial`: a killed PS is started again alone, on its own address, from
its newest checkpoint (`resume`); the other PS and every worker go on (worker/partial.py). When that
cannot be (worker/partial.py, `refusal`: the chief lost, no complete checkpoint yet, a mode other
than async), the launcher says why and rolls the whole cluster back as with `--recovery rollback`.
"""

from __future__ import annotations

from ..base.config import Options
from ..base.lifecycle import RESTART_EXIT_CODE
from ..checkpoint.store import CheckpointError, CheckpointStore
from ..worker.partial import refusal


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
        f"{label} was killed (signal {-code}); restoring shard {shard} alone from its newest checkpoint in "
        f"{options.checkpoint_dir}, on {address}; the other shards and the workers go on (partial recovery, "
        f"restart {restarts})"
    )
