"""Compression "auto" (client/link.py): the choice from measured links, the Probe call that measures
them, and pulls at half width (PushPull's `pull_as`), on in-process shards."""

import numpy as np
import pytest
import torch

from paramserver.base.compression_spec import CompressionSpec
from paramserver.base.errors import FailedPreconditionError, InvalidArgumentError
from paramserver.base.half import bf16_bits_to_float32, float32_to_bf16_bits
from paramserver.base.options import Options
from paramserver.client import link
from paramserver.client.link import AutoCompression, Link, choose
from paramserver.client.ps_client import PSClient
from paramserver.nn.wire_dtype import write_wire
from paramserver.node.in_process import in_process_shards
from paramserver.wire import messages as msg

GBIT = 1e9 / 8  # bytes per second
MLP = 5.34e6  # the seed MLP's float32 gradient (and values) per step, bytes


def test_auto_is_the_default_and_parses_to_no_rules():
    assert Options().compression == "auto"
    spec = CompressionSpec.parse("auto")
    assert spec.auto and not spec and spec.rules == ()
    assert not CompressionSpec.parse("bf16").auto


def test_a_1_gbit_link_that_limits_the_step_gets_bf16_both_ways():
    # the seed MLP at 1 Gbit/s: 118 ms a step, of which about 89 ms on the wire
    links = {0: Link(0.96 * GBIT, 0.96 * GBIT, 2e-4)}
    choice = choose(links, {0: MLP}, {0: MLP}, 0.118, 3e-10)
    assert (choice.codec, choice.pull_as) == ("bf16", "bfloat16")
    assert "0.96 Gbit/s up" in choice.reason and "(1.48x none)" in choice.reason


def test_a_fast_link_or_a_compute_bound_step_stays_uncompressed():
    fast = {0: Link(25 * GBIT, 25 * GBIT, 1e-4)}  # 3.4 ms of wire in a 60 ms step: under 5% to gain
    assert choose(fast, {0: MLP}, {0: MLP}, 0.060, 3e-10).codec == "none"
    slow = {0: Link(0.96 * GBIT, 0.96 * GBIT, 2e-4)}
    small = choose(slow, {0: 1e4}, {0: 1e4}, 0.050, 3e-10)  # 10 kB a step: the link is not the limit
    assert (small.codec, small.pull_as) == ("none", None) and "no codec predicts" in small.reason
    costly = choose(slow, {0: MLP}, {0: MLP}, 0.118, 1e-8)  # converting costs more than the wire saves
    assert costly.codec == "none"


def test_the_slowest_shard_decides_and_no_remote_shard_means_no_compression():
    links = {0: Link(8 * GBIT, 8 * GBIT, 1e-4), 1: Link(0.5 * GBIT, 0.5 * GBIT, 1e-4)}
    choice = choose(links, {0: MLP / 2, 1: MLP / 2}, {0: MLP / 2, 1: MLP / 2}, 0.120, 3e-10)
    assert choice.codec == "bf16" and "link to ps 1" in choice.reason
    assert choose({}, {0: MLP}, {0: MLP}, 0.1, 0.0).reason.startswith("every PS is on this host")


def test_auto_measures_once_times_a_window_then_applies_its_choice_once():
    measured, applied, now = [], [], [0.0]

    def clock():
        now[0] += 0.2  # a step of 200 ms: 160 of them on the wire below
        return now[0]

    slow = Link(0.1 * GBIT, 0.1 * GBIT, 1e-4)  # 12.5 MB/s: 1 MB each way takes 160 ms
    auto = AutoCompression(
        [0], lambda shard: measured.append(shard) or slow, lambda c, p: applied.append((c, p)), clock
    )
    for _ in range(link.WARMUP_STEPS + link.WINDOW_STEPS - 1):
        auto.on_step({0: 10**6}, {0: 10**6}, np.ones(1000, np.float32))
        assert auto.choice is None
    auto.on_step({0: 10**6}, {0: 10**6}, None)
    assert auto.choice is not None and measured == [0]
    assert [(c.kind, p) for c, p in applied] == [("bf16", "bfloat16")]
    auto.on_step({0: 10**6}, {0: 10**6}, None)
    assert len(applied) == 1 and auto.choices == 1  # steps as fast as before: nothing measured again


def scripted_auto(links: list[Link], step_s: list[float]) -> tuple[AutoCompression, list, list]:
    """Auto on one remote shard whose successive measurements are `links`, each step taking `step_s[0]`
    (change it to slow the steps); with the shards it measured and the choices it applied."""
    now, measured, applied = [0.0], [], []

    def clock():
        now[0] += step_s[0]
        return now[0]

    auto = AutoCompression([0], lambda s: measured.append(s) or links[len(measured) - 1],
                           lambda c, p: applied.append((c.kind, p)), clock)
    return auto, measured, applied


def steps(auto: AutoCompression, count: int) -> None:
    for _ in range(count):
        auto.on_step({0: 10**6}, {0: 10**6}, None)


def test_steps_that_slow_down_have_the_links_measured_and_the_choice_made_again():
    step_s = [0.2]
    links = [Link(0.1 * GBIT, 0.1 * GBIT, 1e-4), Link(10 * GBIT, 10 * GBIT, 1e-4)]  # then the link got fast
    auto, measured, applied = scripted_auto(links, step_s)
    steps(auto, link.WARMUP_STEPS + link.WINDOW_STEPS)  # the choice: bf16 both ways
    steps(auto, link.WINDOW_STEPS)  # the first window under it: its step time is the baseline
    assert applied == [("bf16", "bfloat16")] and len(measured) == 1
    step_s[0] = 0.2 * link.SLOWER * 1.5  # e.g. the compute slowed: the link, measured again, is fast now
    steps(auto, link.WINDOW_STEPS)
    assert len(measured) == 2 and auto.choices == 2
    assert applied == [("bf16", "bfloat16"), ("none", None)]  # back to sending as is


def test_with_every_ps_on_this_host_nothing_is_measured_nor_applied():
    auto = AutoCompression([], lambda shard: pytest.fail("measured a local PS"), lambda c, p: pytest.fail("applied"))
    auto.on_step({0: 10**6}, {0: 10**6}, None)
    assert auto.choice is not None and auto.choice.codec == "none"


def test_probe_carries_bytes_both_ways_and_refuses_what_it_cannot_carry():
    client = PSClient(in_process_shards(1), 5.0)
    client.connect(5.0)
    stub = client.stubs[0]
    reply, tensors = stub.probe(msg.ProbeRequest(reply_bytes=1000), 5.0, [("payload", np.ones(10, np.uint8))]).wait(5.0)
    assert tensors["payload"].dtype == np.uint8 and tensors["payload"].size == 1000
    with pytest.raises(InvalidArgumentError, match="reply_bytes"):
        stub.probe(msg.ProbeRequest(reply_bytes=msg.PROBE_MAX_BYTES + 1), 5.0).wait(5.0)
    with pytest.raises(InvalidArgumentError, match="uint8"):
        stub.probe(msg.ProbeRequest(), 5.0, [("payload", np.ones(4, np.float32))]).wait(5.0)
    found = link.measure(stub, 5.0, probe_bytes=1 << 16)
    assert found.up_bytes_s > 0 and found.down_bytes_s > 0 and found.rtt_s >= 0


def test_values_pulled_as_bfloat16_are_the_masters_rounded_and_the_masters_stay_float32():
    client = PSClient(in_process_shards(2), 5.0, split_bytes=64)
    client.connect(5.0)
    values = np.linspace(-3.0, 3.0, 64, dtype=np.float32).reshape(16, 4) + np.float32(1e-3)
    client.register("g", {"name": "sgd", "hyper": {"lr": 0.5}}, {"w": values}).wait(5.0)
    grad = np.full((16, 4), 0.01, np.float32)
    client.pull_as = "bfloat16"
    _, pulled = client.push_pull({"w": grad}, ["w"]).wait(5.0)
    target = torch.zeros(16, 4)
    for part, array in pulled:
        assert array.dtype == np.uint16  # half the bytes
        write_wire(part.name, target[part.lo : part.hi], array)
    master = values - 0.5 * grad
    assert torch.equal(target, torch.from_numpy(bf16_bits_to_float32(float32_to_bf16_bits(master))))
    client.pull_as = None
    _, exact = client.push_pull({}, ["w"]).wait(5.0)
    assert all(array.dtype == np.float32 for _, array in exact)
    assert np.array_equal(np.concatenate([array for _, array in exact]), master)  # the PS kept float32


def test_a_pull_as_other_than_a_half_dtype_is_refused():
    with pytest.raises(InvalidArgumentError, match="pull_as"):
        msg.PushPullRequest.from_meta({"pull_as": "int8"})


def test_a_link_that_cannot_be_measured_means_no_compression():
    def refuse(shard):
        raise FailedPreconditionError("Probe: unknown method")

    auto = AutoCompression([0], refuse, lambda c, p: pytest.fail("applied"))
    auto.on_step({0: 10**6}, {0: 10**6}, None)
    assert auto.choice is not None and auto.choice.codec == "none" and "could not be measured" in auto.choice.reason


def test_a_variable_set_back_to_none_is_sent_as_it_is_and_loses_its_residual():
    from paramserver.base.codecs import NONE
    from paramserver.client.compression import GradientCompressor

    compressor = GradientCompressor()
    compressor.add("w", link.parse("int8"), (4,))
    assert "w" in compressor.codecs and "w" in compressor.residuals
    compressor.add("w", NONE, (4,))
    assert compressor.codecs == {} and compressor.residuals == {}


def test_the_client_counts_plain_bytes_by_shard_and_applies_and_undoes_a_choice():
    from paramserver.base.codecs import NONE

    client = PSClient(in_process_shards(2), 5.0, split_bytes=64)
    client.connect(5.0)
    client.register("g", {"name": "sgd", "hyper": {"lr": 0.1}}, {"w": np.zeros((16, 4), np.float32),
                                                                 "b": np.zeros(3, np.float32)}).wait(5.0)
    counted = client._plain_bytes(["w", "b"])
    assert sum(counted.values()) == 16 * 4 * 4 + 3 * 4 and len(counted) == 2  # w split over both shards
    client.pull_as = "float16"  # the user's
    client.enable_auto(5.0)
    assert client.auto.remote == []  # in-process shards say no host id: this host
    client._apply_auto(link.parse("bf16"), "bfloat16")
    assert set(client.compressor.codecs) == {"w", "b"} and client.pull_as == "float16"
    client._apply_auto(NONE, None)
    assert client.compressor.codecs == {} and client.pull_as == "float16"
    client.pull_as = None
    client.enable_auto(5.0)
    client._apply_auto(link.parse("bf16"), "bfloat16")
    assert client.pull_as == "bfloat16"
    client._apply_auto(NONE, None)
    assert client.pull_as is None  # auto's own choice is undone


def test_a_link_that_slows_right_after_a_choice_of_none_is_measured_again():
    """Nothing changed at the choice, so the window that chose is the baseline: a link shaped right after
    it shows in the next window (it is not taken as the new normal)."""
    step_s = [0.03]
    links = [Link(15 * GBIT, 15 * GBIT, 1e-4), Link(0.1 * GBIT, 0.1 * GBIT, 1e-4)]  # then the link got slow
    auto, measured, applied = scripted_auto(links, step_s)
    # the choice: none (nothing applied: the steps already run uncompressed)
    steps(auto, link.WARMUP_STEPS + max(link.WINDOW_STEPS, int(link.WINDOW_MIN_S / 0.03) + 1))
    assert auto.choice is not None and auto.choice.codec == "none" and applied == [] and len(measured) == 1
    step_s[0] = 0.2  # the link slowed under the running job
    steps(auto, link.WINDOW_STEPS)
    assert len(measured) == 2 and applied == [("bf16", "bfloat16")]
