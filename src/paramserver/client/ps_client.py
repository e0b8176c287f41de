"""The client that talks to every shard of the cluster.

One request per shard per operation carries all of that shard's parts; requests to
different shards are in flight at the same time. Every call has a deadline.

Thread-safety: `register` must not run concurrently with anything else; `push_pull`
may be called from one thread at a time per client (one training loop).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgumentError
from ..transport import codec
from ..transport.channel import CallHandle, ShardChannel
from .placement import DEFAULT_SPLIT_BYTES, Part, Placer

log = logging.getLogger(__name__)


@dataclass
class PushPullHandle:
    """Replies of one push/pull across shards. `wait(timeout)` returns {var: [(part, values)]}."""

    calls: list[tuple[int, CallHandle]]
    parts: dict[str, Part]
    started: float = field(default_factory=time.monotonic)

    def done(self) -> bool:
        return all(call.done() for _, call in self.calls)

    def wait_sent(self, timeout: float) -> None:
        """Return once every request was copied out: the pushed arrays may then change."""
        deadline = time.monotonic() + timeout
        for _, call in self.calls:
            call.wait_sent(max(0.0, deadline - time.monotonic()))

    def wait(self, timeout: float) -> tuple[dict[int, int], list[tuple[Part, np.ndarray]]]:
        """Block until every shard replied; returns ({shard: version}, [(part, values)]).

        The values may view transport buffers: consume them before the next call on this client.
        """
        deadline = time.monotonic() + timeout
        versions, values = {}, []
        for shard, call in self.calls:
            frame = codec.decode(call.wait(max(0.0, deadline - time.monotonic())))
            versions[shard] = frame.meta["version"]
            values.extend((self.parts[name], array) for name, array in frame.tensors.items())
        return versions, values


class PSClient:
    """Registers variables on the shards, pushes gradients and pulls values."""

    def __init__(self, channels: list[ShardChannel], rpc_timeout_s: float,
                 split_bytes: int = DEFAULT_SPLIT_BYTES) -> None:
        self.channels = channels
        self.rpc_timeout_s = rpc_timeout_s
        self.placer = Placer(len(channels), split_bytes)
        self.parts_of: dict[str, list[Part]] = {}
        self._part_by_name: dict[str, Part] = {}
        self._groups_on: dict[int, set[str]] = {}

    @property
    def num_shards(self) -> int:
        return len(self.channels)

    def connect(self, timeout: float) -> None:
        """Wait until every shard answered Hello (which also checks the protocol version)."""
        deadline = time.monotonic() + timeout
        for channel in self.channels:
            channel.wait_ready(max(0.1, deadline - time.monotonic()))

    def register(self, group: str, optimizer_spec: dict, values: dict[str, np.ndarray]):
        """Place and register a group of variables; returns the handle of the shards' current values."""
        by_shard: dict[int, list[tuple[str, np.ndarray]]] = {}
        for var, array in values.items():
            if var in self.parts_of:
                raise InvalidArgumentError(f"variable {var!r} is already registered")
            parts = self.placer.place(var, tuple(array.shape), array.dtype.itemsize)
            self.parts_of[var] = parts
            for part in parts:
                self._part_by_name[part.name] = part
                by_shard.setdefault(part.shard, []).append((part.name, _rows(array, part)))
        for shard in by_shard:
            self._groups_on.setdefault(shard, set()).add(group)
        calls = [(shard, self.channels[shard].call(
            "Register", codec.encode_parts({"group": group, "optimizer": optimizer_spec}, tensors), self.rpc_timeout_s))
            for shard, tensors in sorted(by_shard.items())]
        return PushPullHandle(calls, self._part_by_name)

    def push_pull(self, grads: dict[str, np.ndarray], pull: list[str], lrs: dict[str, float] | None = None,
                  ) -> PushPullHandle:
        """Push `grads` (by variable) and pull the variables in `pull`, one request per shard involved."""
        pushed: dict[int, list[tuple[str, np.ndarray]]] = {}
        for var, grad in grads.items():
            for part in self.parts_of[var]:
                pushed.setdefault(part.shard, []).append((part.name, _rows(grad, part)))
        pulled: dict[int, list[str]] = {}
        for var in pull:
            for part in self.parts_of[var]:
                pulled.setdefault(part.shard, []).append(part.name)
        calls = []
        for shard in sorted(set(pushed) | set(pulled)):
            meta = {"pull": pulled.get(shard, [])}
            shard_lrs = {g: lr for g, lr in (lrs or {}).items() if g in self._groups_on.get(shard, ())}
            if shard_lrs:
                meta["lr"] = shard_lrs
            payload = codec.encode_parts(meta, pushed.get(shard, ()))
            calls.append((shard, self.channels[shard].call("PushPull", payload, self.rpc_timeout_s)))
        return PushPullHandle(calls, self._part_by_name)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def _rows(array: np.ndarray, part: Part) -> np.ndarray:
    return array if part.whole else array[part.lo:part.hi]
