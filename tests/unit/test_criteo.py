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


def test_a_malformed_line_of_a_workers_share_is_named_by_its_number_in_the_file(tmp_path):
    path = tmp_path / "part.tsv"
    path.write_text(LINE * 5 + "1\tnot-a-number\n" + LINE)
    with pytest.raises(criteo.CriteoFormatError, match="line 6: "):
        list(criteo.batches(path, 2, skip=1, every=2))  # this worker reads lines 2, 4, 6


@pytest.mark.parametrize("skip, every", [(2, 2), (-1, 2), (0, 0)])
def test_a_share_outside_the_workers_is_refused(skip, every):
    with pytest.raises(criteo.InvalidArgumentError, match="0 <= skip < every"):
        list(criteo.batches([LINE], 1, skip=skip, every=every))


def test_generator_writes_the_exact_format_with_learnable_labels(tmp_path):
    path = tmp_path / "train.tsv"
    subprocess.run([sys.executable, str(ROOT / "examples" / "ctr_data.py"), "--rows", "2000", "--out", str(path)],
                   check=True, timeout=120)
    labels = np.concatenate([b[2].numpy() for b in criteo.batches(str(path), 512)])
    assert labels.shape == (2000,) and 0.05 < labels.mean() < 0.95


TRICKY = [
    LINE,
    LINE.replace("\t3\t", "\t-7\t", 1),  # a negative count reads as 0
    LINE.replace("0000000a", "a-value-longer-than-sixteen-bytes"),  # hashed on its first 16 bytes
    LINE.replace("\t3\t", "\t1234567890123456789\t", 1),  # 19 digits: outside the C parser's subset
    LINE.replace("1\t", "1.0\t", 1),  # a float label: numpy's path takes it
    LINE.replace("0000000a", "caf\u00e9"),  # not ASCII
    LINE.rstrip("\n") + "\r\n",  # Windows line end: the last value keeps its "\r", on both paths
    LINE.rstrip("\n"),  # a last line without its newline
]


@pytest.mark.parametrize("index", range(len(TRICKY)))
def test_the_c_parser_and_numpy_agree_line_by_line(index, monkeypatch):
    from paramserver.server import kernels

    if kernels.KERNELS is None:
        pytest.skip("C kernels not built")
    def parse():
        try:
            return criteo.parse_lines([LINE, TRICKY[index]])
        except criteo.CriteoFormatError as exc:  # then both must refuse it, alike
            return str(exc)

    fast = parse()
    monkeypatch.setattr(kernels, "KERNELS", None)
    plain = parse()
    assert type(fast) is type(plain)
    if isinstance(fast, str):
        assert fast == plain and "line 2" in fast
    else:
        for a, b in zip(fast, plain):
            np.testing.assert_array_equal(a, b)


def test_the_c_parser_takes_the_plain_format_and_declines_the_rest():
    from paramserver.server import kernels

    if kernels.KERNELS is None:
        pytest.skip("C kernels not built")
    assert criteo._parse_plain([LINE, TRICKY[1], TRICKY[2], TRICKY[6]]) is not None
    for odd in (TRICKY[3], TRICKY[4], TRICKY[5], "1\t2\t3\n"):
        assert criteo._parse_plain([LINE, odd]) is None
