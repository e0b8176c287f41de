"""One node of a Ray run as the engine (launch/ray/engine.py) follows it: its actor, where Ray placed it, and how
its node process ended. The engine's follower thread of the node sets `code` or `lost`, then `ended`; the
driving thread reads them once `ended` is set."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

LEAVE_S = 60.0  # an elastic run's worker asked to leave: how long it may take (its step, its data handed back)


@dataclass
class Node:
    """A PS or worker of the run: its actor, and how its node process ended (set by its follower thread)."""

    label: str
    role: str
    index: int
    actor: Any
    where: dict[str, str] = field(default_factory=dict)  # its Ray node's ip and node_id, once asked
    code: int | None = None  # the node process's exit code (negative: the signal), once it ended
    lost: str = ""  # why the actor died (its Ray node lost), when it did
    ended: threading.Event = field(default_factory=threading.Event)
    follower: threading.Thread | None = None

    def poll(self) -> int | None:
        """None while it runs; once it ended, its exit code (negative: the signal; -9 for an actor lost)."""
        if not self.ended.is_set():
            return None
        return self.code if self.code is not None else -9

    def terminate(self) -> None:
        """Ask its node process to stop (SIGTERM; SIGKILL after LEAVE_S): an elastic run's worker leaves."""
        self.actor.stop.remote(LEAVE_S)


def killed(node: Node) -> bool:
    """Its actor died (its Ray node lost) or its process was killed by a signal."""
    return bool(node.lost) or (node.code is not None and node.code < 0)


def how(node: Node) -> str:
    """How a node ended, in words."""
    if node.lost:
        return f"was lost with its Ray actor ({node.lost})"
    if node.code is not None and node.code < 0:
        return f"was killed (signal {-node.code})"
    return f"exited with code {node.code}"
