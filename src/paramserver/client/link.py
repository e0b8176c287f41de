"""`compression` "auto": compress where the link to a PS is what limits the step, from measurements.

At a worker's first step each PS on another host has its link timed (`measure`: Probe calls on the
channel training uses: the round trip, then 4 MiB up and 4 MiB back). A PS on this host (its Hello's
host id is ours: loopback, shared memory) is never compressed for, and nothing is measured: there the
codecs only cost. After `WINDOW_STEPS` timed steps (past `WARMUP_STEPS`), `choose` predicts each
candidate's step time from the measured step, the bytes the step moves per PS and the measured links,
and takes the fastest; one that is not `MIN_GAIN` faster than sending everything as is loses to it.

Candidates, all safe for convergence (no sparsification, no quantization: those change what trains,
and are the user's to choose): float32 both ways; bf16 pushes (base/codecs/bf16.py); bf16 pushes and
pulls (the PS sends its float32 masters' values as bfloat16: PushPull's `pull_as`). Only float32
dense variables are affected; embedding rows travel as their tables say.

The choice is logged with its reason. Steps keep being timed in windows: when one is `SLOWER` than the
first window after the choice, the links are measured again and the choice made again from the step
as it is now (another job on the link, a PS moved). Not thread-safe: the client's caller thread drives
it (PSClient.push_pull).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from paramserver.base.compression_spec import Codec, parse
from paramserver.base.errors import ParamServerError
from paramserver.base.half import float32_to_bf16_bits
from paramserver.wire import messages as msg
from paramserver.wire.stubs import ShardStub

log = logging.getLogger(__name__)

PROBE_BYTES = 4 << 20  # each way: 34 ms at 1 Gbit/s, long enough that the round trip is a small part
WARMUP_STEPS = 5  # steps not timed: the first ones allocate, compile and fill caches
WINDOW_STEPS = 20  # steps timed before the choice...
WINDOW_MIN_S = 1.0  # ...and at least this long
MIN_GAIN = 0.05  # a candidate must predict a step this much faster than no compression
SLOWER = 1.5  # steps this much slower than the first window after a choice: measure the links again


@dataclass(frozen=True)
class Link:
    """A measured link to one PS: payload bytes per second each way, and the round trip."""

    up_bytes_s: float
    down_bytes_s: float
    rtt_s: float

    def describe(self) -> str:
        return (
            f"{self.up_bytes_s * 8 / 1e9:.2f} Gbit/s up, {self.down_bytes_s * 8 / 1e9:.2f} down, "
            f"round trip {self.rtt_s * 1e3:.2f} ms"
        )


@dataclass(frozen=True)
class Choice:
    """What auto chose: the push codec ("none" or "bf16"), the pull dtype (None: float32), and why."""

    codec: str
    pull_as: str | None
    reason: str


NONE_CHOICE: tuple[str, str | None] = ("none", None)
CANDIDATES: tuple[tuple[str, str | None], ...] = (NONE_CHOICE, ("bf16", None), ("bf16", "bfloat16"))


def measure(stub: ShardStub, timeout: float, probe_bytes: int = PROBE_BYTES) -> Link:
    """Time the link of `stub`'s channel: the best of three empty round trips, then `probe_bytes` up
    and `probe_bytes` back, each the best of two (other traffic only slows a transfer)."""

    def timed(request: msg.ProbeRequest, tensors) -> float:
        started = time.perf_counter()
        stub.probe(request, timeout, tensors).wait(timeout)
        return time.perf_counter() - started

    rtt = min(timed(msg.ProbeRequest(), ()) for _ in range(3))
    payload = [("payload", np.zeros(probe_bytes, np.uint8))]
    up = min(timed(msg.ProbeRequest(), payload) for _ in range(2))
    down = min(timed(msg.ProbeRequest(reply_bytes=probe_bytes), ()) for _ in range(2))
    return Link(probe_bytes / max(up - rtt, 1e-6), probe_bytes / max(down - rtt, 1e-6), rtt)


def choose(
    links: dict[int, Link],
    pushed: dict[int, float],
    pulled: dict[int, float],
    step_s: float,
    bf16_s_per_byte: float,
    current: tuple[str, str | None] = NONE_CHOICE,
) -> Choice:
    """The fastest candidate for a step of `step_s` seconds, measured under the `current` choice, that
    pushes `pushed[shard]` and pulls `pulled[shard]` float32 bytes (before any codec) to the PS of
    `links` (the remote ones). A step's wire time is its slowest shard's (calls to the shards go out
    together); the rest of the step (compute, the PS's work) stays as measured. `bf16_s_per_byte`:
    converting one float32 byte to bfloat16 or back, paid on each side of a link."""
    if not links:
        return Choice(*NONE_CHOICE, "every PS is on this host: nothing to gain on its links")

    def wire_s(codec: str, pull_as: str | None) -> float:
        up_factor, down_factor = (0.5 if codec == "bf16" else 1.0), (0.5 if pull_as else 1.0)
        return max(
            pushed.get(s, 0.0) * up_factor / link.up_bytes_s + pulled.get(s, 0.0) * down_factor / link.down_bytes_s
            for s, link in links.items()
        )

    def convert_s(codec: str, pull_as: str | None) -> float:
        converted = (sum(pushed.values()) if codec == "bf16" else 0.0) + (sum(pulled.values()) if pull_as else 0.0)
        return 2 * converted * bf16_s_per_byte  # encoded on one side, decoded on the other

    base_wire = wire_s(*NONE_CHOICE)
    rest = max(0.0, step_s - wire_s(*current) - convert_s(*current))  # compute, the PS's work: no codec changes it
    predicted = {c: rest + wire_s(*c) + convert_s(*c) for c in CANDIDATES}
    best = min(predicted, key=lambda c: predicted[c])
    slowest = min(links, key=lambda s: min(links[s].up_bytes_s, links[s].down_bytes_s))
    said = (
        f"link to ps {slowest}: {links[slowest].describe()}; a step moves "
        f"{sum(pushed.values()) / 1e6:.2f} MB up and {sum(pulled.values()) / 1e6:.2f} MB down of float32 values: "
        f"{base_wire * 1e3:.1f} ms of wire uncompressed, a {step_s * 1e3:.1f} ms step"
    )
    if predicted[best] > predicted[NONE_CHOICE] * (1 - MIN_GAIN) or best == NONE_CHOICE:
        return Choice(*NONE_CHOICE, f"{said}; no codec predicts a step {MIN_GAIN:.0%} faster")
    what = "bf16 pushes" + (", pulls as bfloat16" if best[1] else "")
    gain = predicted[NONE_CHOICE] / predicted[best]
    return Choice(best[0], best[1], f"{said}; {what} predict {predicted[best] * 1e3:.1f} ms ({gain:.2f}x none)")


def bf16_cost_s_per_byte(sample: np.ndarray | None) -> float:
    """Seconds to convert one float32 byte to bfloat16, timed on `sample` (a gradient of this run)."""
    if sample is None or sample.size == 0:
        return 0.0
    values = np.ascontiguousarray(sample, np.float32)
    out = np.empty(values.shape, np.uint16)
    started = time.perf_counter()
    float32_to_bf16_bits(values, out)
    return (time.perf_counter() - started) / values.nbytes


class AutoCompression:
    """Drives `compression` "auto" for one PSClient: measure the links at the first step, time a window
    of steps, choose, apply the choice through `apply(codec, pull_as)`; then keep timing windows, and
    measure and choose again when steps slow."""

    def __init__(
        self,
        remote: Sequence[int],
        measure_link: Callable[[int], Link],
        apply: Callable[[Codec, str | None], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.remote, self._measure, self._apply, self._clock = list(remote), measure_link, apply, clock
        self.links: dict[int, Link] = {}
        self.choice: Choice | None = None
        self.choices = 0  # how many times it chose (a re-measure after steps slowed chooses again)
        self._baseline_s: float | None = None  # the step time of the first window under the choice
        self._steps = 0
        self._started = 0.0
        self._pushed: dict[int, float] = {}
        self._pulled: dict[int, float] = {}
        self._sample: np.ndarray | None = None

    @property
    def watching(self) -> bool:
        """Whether steps still need to be reported: until the choice, and after it while any PS is remote."""
        return self.choice is None or (bool(self.remote) and bool(self.links))

    def on_step(self, pushed: dict[int, int], pulled: dict[int, int], sample: np.ndarray | None) -> None:
        """Called before each PushPull that pushes gradients, with its plain float32 bytes by shard."""
        if not self.remote:
            self._decide(Choice(*NONE_CHOICE, "every PS is on this host: nothing to gain on its links"))
            return
        if not self.links and not self._measure_links():
            return
        self._steps += 1
        if self._steps <= WARMUP_STEPS:
            self._started = self._clock()
            return
        for shard in self.remote:
            self._pushed[shard] = self._pushed.get(shard, 0.0) + pushed.get(shard, 0)
            self._pulled[shard] = self._pulled.get(shard, 0.0) + pulled.get(shard, 0)
        self._sample = sample if sample is not None else self._sample
        timed, elapsed = self._steps - WARMUP_STEPS, self._clock() - self._started
        if timed < WINDOW_STEPS or elapsed < WINDOW_MIN_S:
            return
        # the bytes of the step this one's call ends are counted: `timed` steps took `elapsed`
        step_s = elapsed / timed
        per_step = {s: b / timed for s, b in self._pushed.items()}, {s: b / timed for s, b in self._pulled.items()}
        self._next_window()
        if self.choice is None:
            self._decide(choose(self.links, *per_step, step_s, bf16_cost_s_per_byte(self._sample)), step_s)
        elif self._baseline_s is None:
            self._baseline_s = step_s
        elif step_s > SLOWER * self._baseline_s:
            log.info(
                "compression auto: steps slowed from %.1f to %.1f ms: the links are measured again",
                self._baseline_s * 1e3,
                step_s * 1e3,
            )
            if self._measure_links():
                current = (self.choice.codec, self.choice.pull_as)
                self._decide(choose(self.links, *per_step, step_s, bf16_cost_s_per_byte(self._sample), current), step_s)

    def _measure_links(self) -> bool:
        started = time.monotonic()
        try:
            self.links = {shard: self._measure(shard) for shard in self.remote}
        except ParamServerError as exc:  # e.g. a PS of protocol 2.2, which has no Probe
            self.links = {}
            self._decide(Choice(*NONE_CHOICE, f"the links could not be measured ({exc})"))
            return False
        log.info("compression auto: links measured in %.2fs", time.monotonic() - started)
        return True

    def _next_window(self) -> None:
        self._steps, self._started = WARMUP_STEPS, self._clock()
        self._pushed, self._pulled = {}, {}

    def _decide(self, choice: Choice, window_s: float | None = None) -> None:
        """Take `choice`. Its baseline is the next window's step time, or, when it keeps what the steps
        already ran with, `window_s`: the window that chose (a link that slows right after the choice
        then shows against it, not inside the baseline)."""
        before = (self.choice.codec, self.choice.pull_as) if self.choice is not None else NONE_CHOICE
        kept = (choice.codec, choice.pull_as) == before
        self.choice, self._baseline_s = choice, (window_s if kept else None)
        self.choices += 1
        log.info(
            "compression auto: %s → %s%s",
            choice.reason,
            choice.codec,
            f" / pull {choice.pull_as}" if choice.pull_as else "",
        )
        if not kept:
            self._apply(parse(choice.codec), choice.pull_as)
