"""The Criteo-format reader and the synthetic generator."""

import math
import subprocess
import sys

import numpy as np
import pytest

from paramserver.data import criteo
from tests.conftest import ROOT

LINE = "1\t" + "\t".join(["3", ""] + ["0"] * 11) + "\t" + "\t".join(["0000000a", ""] + ["ff"] * 24) + "\n"


def test_a_line_with_missing_values_parses():
    dense, sparse, labels = criteo.parse_lines([LINE, LINE.replace("0000000a", "0000000b")])
    assert labels.tolist() == [1.0, 1.0]
    assert dense[0, 0] == pytest.approx(math.log1p(3)) and dense[0, 1] == 0.0
    assert (sparse[:, 2:] >> 56).tolist() == [list(range(2, 26))] * 2  # the feature index keeps features apart
    assert sparse[0, 0] != sparse[1, 0] and sparse[0, 2] == sparse[1, 2]  # same string, same id
    assert sparse[0, 1] != sparse[0, 0]  # an empty value is a value of its own


def test_batches_stream_and_shard_by_line():
    lines = [LINE] * 10
    got = list(criteo.batches(lines, 3, skip=1, every=2))
    assert [len(b[2]) for b in got] == [3, 2]  # lines 1, 3, 5, 7, 9
    dense, sparse, labels = got[0]
    assert dense.shape == (3, 13) and sparse.shape == (3, 26) and sparse.dtype.is_floating_point is False


@pytest.mark.parametrize("line, fragment", [
    ("1\t2\t3\n", "3 fields"),
    (LINE.replace("\t3\t", "\tthree\t", 1), "invalid literal"),
])
def test_malformed_lines_name_their_number(line, fragment):
    with pytest.raises(criteo.CriteoFormatError, match=f"line 2: .*{fragment}|line 2: {fragment}"):
        list(criteo.batches([LINE, line], 4))


def test_generator_writes_the_exact_format_with_learnable_labels(tmp_path):
    path = tmp_path / "train.tsv"
    subprocess.run([sys.executable, str(ROOT / "examples" / "ctr_data.py"), "--rows", "2000", "--out", str(path)],
                   check=True, timeout=120)
    labels = np.concatenate([b[2].numpy() for b in criteo.batches(str(path), 512)])
    assert labels.shape == (2000,) and 0.05 < labels.mean() < 0.95
