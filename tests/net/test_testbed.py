"""The emulated network of bench/net/: a shaped link carries its rate, and nothing it made outlives it.

The `net` tier: namespaces, tc and processes pinned to CPUs, so root; skipped elsewhere with the reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bench.net.link_rate import measure
from bench.net.testbed import Network, NetworkError, namespaces, unavailable

pytestmark = pytest.mark.net

needs_root = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")
TRIES = 3  # other work on the cores only slows a transfer: the best try is the link's reading


@needs_root
def test_a_1_gbit_link_carries_its_rate_within_10_percent():
    with Network() as net:
        ps, worker = net.add_host("ps", "0"), net.add_host("worker0", "1")
        net.shape(1.0)
        rates = []
        for _ in range(TRIES):
            rates.append(measure(net, worker, ps, seconds=2.0))
            assert rates[-1] <= 1.1, rates  # never past the bucket: the shaping holds
            if rates[-1] >= 0.9:
                break
        assert max(rates) >= 0.9, rates


@needs_root
def test_every_namespace_qdisc_and_process_it_made_is_gone_after_it():
    with Network() as net:
        host = net.add_host("ps", "0")
        net.add_host("worker0", "1")
        net.shape(1.0)
        assert len(net.qdiscs()) == 4  # each host's link, both ways
        sleeper = net.start(host, ["sleep", "300"], env=None, out=Path(os.devnull))
        assert len(net.leftovers()) == 3  # the switch and two hosts
    assert sleeper.poll() is not None
    assert not [name for name in namespaces() if name.startswith(net.tag)]


@needs_root
def test_an_exception_inside_removes_everything_too():
    with pytest.raises(RuntimeError, match="a failure inside"), Network() as net:
        net.add_host("ps", "0")
        net.shape(1.0)
        raise RuntimeError("a failure inside")
    assert net.leftovers() == []


@needs_root
def test_unshaping_removes_the_buckets():
    with Network() as net:
        net.add_host("ps", "0")
        net.shape(10.0)
        net.shape(None)
        assert net.qdiscs() == []


def test_without_root_it_says_why(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert "needs root" in (unavailable() or "")
    with pytest.raises(NetworkError, match="needs root"), Network():
        pass


@needs_root
def test_compression_auto_compresses_both_ways_across_a_1_gbit_link(tmp_path):
    """The seed MLP's worker on another host than its two PS, every link 1 Gbit/s: auto measures both
    links and chooses bf16 both ways (the step is mostly wire). (On one host it measures nothing:
    tests/unit/test_link_choice.py.)"""
    from bench.net.cluster import run_case
    from bench.net.run import place_hosts, worker_script

    with Network() as net:
        ps, workers = place_hosts(net, 2, 1)
        net.shape(1.0)
        figures = run_case(net, ps, workers, worker_script("mlp", tmp_path, 4.0), "auto", 4.0, tmp_path)
    assert figures["auto_chose"] == ["bf16 / pull bfloat16"], figures


@needs_root
def test_compression_auto_chooses_again_when_the_link_slows_mid_run(tmp_path):
    """Unshaped, auto measures a fast link and compresses nothing; once the link is shaped to 1 Gbit/s
    under the running worker, its steps slow, it measures the link again and compresses both ways."""
    import threading
    import time

    from bench.net.cluster import run_case
    from bench.net.run import place_hosts, worker_script

    out = tmp_path / "worker0.out"
    figures: dict = {}
    with Network() as net:
        ps, workers = place_hosts(net, 1, 1)
        net.shape(None)
        script = worker_script("mlp", tmp_path, 12.0)
        run = threading.Thread(
            target=lambda: figures.update(run_case(net, ps, workers, script, "auto", 12.0, tmp_path)),
            name="net-case",
        )
        run.start()
        deadline = time.monotonic() + 90
        while not choices(out) and run.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert choices(out) == ["none"], out.read_text()[-3000:] if out.exists() else "no output"
        net.shape(1.0)
        run.join(150)
        assert not run.is_alive(), "the case did not end"
    assert figures, "the case failed (its error is in the thread's output above)"
    text = out.read_text()
    assert "steps slowed from" in text, text[-3000:]
    assert choices(out)[-1] == "bf16 / pull bfloat16", text[-3000:]


def choices(out: Path) -> list[str]:
    """What compression auto chose, in order, from a worker's log (client/link.py's INFO lines)."""
    if not out.exists():
        return []
    lines = out.read_text(errors="replace").splitlines()
    return [line.rsplit("→", 1)[1].strip() for line in lines if "compression auto:" in line and "→" in line]
