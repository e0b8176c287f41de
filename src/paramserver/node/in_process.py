"""An in-process cluster: shards and a coordinator in this process, reached without sockets.

For a plain `python script.py` with no cluster configured, and for fast tests. Every request
crosses the same codec and services as over gRPC (transport/inprocess.py).
"""

from __future__ import annotations

from paramserver.coordinator.coordinator_service import CoordinatorService
from paramserver.coordinator.membership import Coordinator
from paramserver.server.shard import Shard
from paramserver.server.shard_service import ShardService
from paramserver.transport.channel import ShardChannel
from paramserver.transport.inprocess import InProcessChannel


def in_process_shards(num_ps: int) -> list[ShardChannel]:
    """One channel to each of `num_ps` new shards."""
    return [InProcessChannel(ShardService(Shard(index))) for index in range(num_ps)]


def in_process_coordinator(num_workers: int = 1) -> InProcessChannel:
    """A channel to a new coordinator of `num_workers` workers."""
    return InProcessChannel(CoordinatorService(Coordinator(num_workers)), "inprocess:coordinator")
