"""`recovery` "partial" on Ray: a lost PS restored alone, from its newest checkpoint, on its own address.

The workers find a restored shard where they last reached it (worker/recovery/partial.py): on the same
HOST:PORT. So the new PS actor goes back to the lost one's Ray node when that node is still alive (only its
process was killed): into its placement group bundle, whose resources the old actor gave back; else to any
node with room. Its shard is restored alone only when that node's address is the lost PS's host. On a
cluster whose nodes each have their own address, a PS whose Ray node was lost comes back elsewhere, on
another address: the engine then rolls the whole cluster back instead, saying why. Pure functions but
`Plan.strategy`, which builds a Ray scheduling strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paramserver.base.config import Options
from paramserver.launch.local.shard_restart import why_not_alone


@dataclass(frozen=True)
class Plan:
    """Whether a lost PS is restored alone (`refused` None) and whether its new actor goes back to its Ray node."""

    refused: str | None  # why not ("" with recovery "rollback": nothing to say), or None
    same_node: bool = False

    def strategy(self, group: Any, bundle: int) -> Any:
        """The new actor's scheduling strategy: bundle `bundle` of placement group `group` (on the old actor's Ray
        node) when it goes back there, else wherever there is room."""
        if not self.same_node or group is None:
            return "SPREAD"
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)


def plan(options: Options, code: int | None, node_lost: bool) -> Plan:
    """How a PS that ended with `code` (None: its actor died) is recovered from: restored alone, or not (the
    engine rolls back). `node_lost`: its actor died with its Ray node."""
    refused = why_not_alone(options, True, code)
    if refused is not None:
        return Plan(refused)
    return Plan(None, same_node=not node_lost)


def refusal_on(address: str, where: dict[str, str]) -> str | None:
    """Why a shard last served at `address` cannot come back on the Ray node at `where`, or None when it can."""
    host = address.rsplit(":", 1)[0]
    if where.get("ip") == host:
        return None
    return (
        f"its new Ray node's address {where.get('ip')} is not its address {host}, where the workers reach it; "
        f"rolling the whole cluster back instead"
    )


def line(label: str, how: str, shard: int, options: Options, address: str, restarts: str) -> str:
    """The engine's line when it restores shard `shard` alone."""
    return (
        f"{label} {how}; restoring shard {shard} alone from its newest checkpoint in {options.checkpoint_dir}, "
        f"on {address}; the other shards and the workers go on (partial recovery, restart {restarts})"
    )
