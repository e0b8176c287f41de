"""The loader process: same batches as parsing inline, errors raised in the training loop, no leftovers."""

import os
import signal
import time

import numpy as np
import psutil
import pytest
from tests.wait import wait_until

from paramserver.data import criteo
from paramserver.data.loader import BatchLoader, LoaderError


def line(rng: np.random.Generator) -> str:
    dense = [str(v) if v >= 0 else "" for v in rng.integers(-1, 100, 13)]
    sparse = [f"{v:08x}" if v else "" for v in rng.integers(0, 50, 26)]
    return "\t".join([str(rng.integers(2))] + dense + sparse) + "\n"


@pytest.fixture
def tsv(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "train.tsv"
    path.write_text("".join(line(rng) for _ in range(1000)))
    return path


@pytest.mark.cluster
def test_batches_from_the_loader_equal_batches_parsed_inline(tsv):
    inline = list(criteo.batches(tsv, 64, skip=1, every=2))
    loaded = list(criteo.batches(tsv, 64, skip=1, every=2, prefetch=3))
    assert len(loaded) == len(inline) == 8
    for a, b in zip(inline, loaded):
        for x, y in zip(a, b):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x.numpy(), y.numpy())


@pytest.mark.cluster
def test_a_bad_line_raises_in_the_training_loop_naming_the_line(tsv):
    with open(tsv, "a") as handle:
        handle.write("1\tnot-a-number\n")
    with pytest.raises(criteo.CriteoFormatError, match="line 1001"):
        for _ in criteo.batches(tsv, 100, prefetch=2):
            pass


@pytest.mark.cluster
def test_leaving_the_loop_early_stops_the_loader_process(tsv):
    before = {p.pid for p in psutil.Process().children()}
    for _ in criteo.batches(tsv, 10, prefetch=2):
        started = {p.pid for p in psutil.Process().children()} - before
        break
    assert len(started) == 1
    pid = started.pop()
    wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
               "the loader process to exit after the loop was left")


@pytest.mark.cluster
def test_a_killed_loader_is_an_error_not_a_hang(tsv):
    loader = BatchLoader(criteo.array_batches, [str(tsv)], 1, depth=1, timeout_s=20).start()
    batches = iter(loader)
    next(batches)
    os.kill(loader._proc.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(LoaderError, match="exited with code"):
        for _ in batches:
            pass
    assert time.monotonic() - started < 10
