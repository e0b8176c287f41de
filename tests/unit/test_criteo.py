"""The Criteo-format reader and the synthetic generator.

Tests taking `both_kernel_paths` run once with the C parser and once with numpy: the two must
give the same arrays and refuse the same lines with the same messages.
"""

import math
import struct

import numpy as np
import pytest
from tests.criteo_lines import LINE, bad_file, line

from paramserver.base import kernels
from paramserver.data import criteo


def test_a_line_with_missing_values_parses(both_kernel_paths):
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


# ---- Bad lines: each kind refused, naming the file, the line and the field ----

BAD = [  # (line, field named, fragment of the message)
    (line(counts=["12345678901234567890123"]), "I1", "'12345678901234567890123' does not fit in a 64-bit integer"),
    (line(counts=["0", "9223372036854775808"]), "I2", "does not fit in a 64-bit integer"),
    (line(counts=["-9223372036854775809"]), "I1", "does not fit in a 64-bit integer"),
    (line(counts=["1" * 5000]), "I1", "does not fit in a 64-bit integer"),  # past int()'s digit limit too
    (line(counts=["three"]), "I1", "'three' is not an integer"),
    (line(counts=["+5"]), "I1", "'+5' is not an integer"),
    (line(counts=[" 5"]), "I1", "is not an integer"),
    (line(counts=["1_000"]), "I1", "is not an integer"),  # int() would take it
    (line(counts=["-"]), "I1", "is not an integer"),
    (line(counts=["5-"]), "I1", "is not an integer"),
    (line(counts=["1.5"]), "I1", "is not an integer"),
    (line(label="2"), "label", "label '2' is not 0 or 1"),
    (line(label="-1"), "label", "label '-1' is not 0 or 1"),
    (line(label="0.5"), "label", "label '0.5' is not 0 or 1"),
    (line(label="1.0"), "label", "label '1.0' is not 0 or 1"),
    (line(label="10"), "label", "label '10' is not 0 or 1"),
    (line(label=""), "label", "label '' is not 0 or 1"),
    ("1\t2\t3\n", None, "3 fields, expected 40"),
    (LINE.replace("\n", "\tff\n"), None, "41 fields, expected 40"),
    (line(values=["a\0b"]), "C1", "a NUL byte at column"),
]
BAD_BYTES = [  # lines that are not UTF-8: only a file (or bytes) can hold them
    (line(values=["caf"]).encode().replace(b"caf", b"caf\xe9"), "C1", "not UTF-8 (byte 0xe9"),
    (line(counts=["7"]).encode().replace(b"\t7\t", b"\t7\xff\t"), "I1", "not UTF-8 (byte 0xff"),
    (line(values=["", "x"]).encode().replace(b"\tx\t", b"\t\xed\xa0\x80\t"), "C2", "not UTF-8 (byte 0xed"),
]


@pytest.mark.parametrize("bad, field, fragment", BAD + BAD_BYTES)
def test_each_bad_line_is_refused_naming_file_line_and_field(bad, field, fragment, tmp_path, both_kernel_paths):
    path = bad_file(tmp_path, bad)
    with pytest.raises(criteo.CriteoFormatError) as caught:
        list(criteo.array_batches(str(path), 3))  # the bad line is the 2nd of the 2nd batch
    message = str(caught.value)
    assert message.startswith(f"{path}: line 5: ") and fragment in message
    assert (caught.value.path, caught.value.line, caught.value.field) == (str(path), 5, field)
    if field is not None:
        assert f"field {criteo.FIELD_NAMES.index(field) + 1} ({field}): " in message
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("bad, field, fragment", BAD)
def test_bad_lines_given_directly_are_named_by_their_number(bad, field, fragment, both_kernel_paths):
    with pytest.raises(criteo.CriteoFormatError) as caught:
        list(criteo.batches([LINE, bad], 4))
    assert str(caught.value).startswith("line 2: ") and fragment in str(caught.value)
    assert caught.value.path is None and caught.value.line == 2


@pytest.mark.parametrize("lines, first", [
    ([LINE, line(label="7"), line(counts=["x"]), "1\t2\n"], 2),
    ([LINE, line(counts=["x"]), line(label="7")], 2),
    ([LINE, LINE, "1\t2\n", line(label="7")], 3),
    ([LINE, LINE, line(label="7"), "1\t2\n"], 3),
])
def test_the_first_bad_line_of_a_batch_is_named_whatever_is_wrong_with_later_ones(lines, first, both_kernel_paths):
    with pytest.raises(criteo.CriteoFormatError, match=f"^line {first}: "):
        criteo.parse_lines(lines)


def test_a_line_ending_inside_a_utf8_sequence_is_refused_though_the_next_would_complete_it(both_kernel_paths):
    cut = line(values=["x"] * 26).encode().replace(b"\tx\n", b"\tx\xc3\n")
    with pytest.raises(criteo.CriteoFormatError, match="^line 2: field 40 \\(C26\\): not UTF-8 \\(byte 0xc3"):
        criteo.parse_lines([LINE.encode(), cut, b"\xa9" + LINE.encode()])


def test_misaligned_lines_are_refused_though_their_fields_add_up(both_kernel_paths):
    long, short = LINE.replace("\n", "\tff\n"), LINE.replace("\tff\n", "\n")  # 41 and 39 fields: 80 in all
    with pytest.raises(criteo.CriteoFormatError, match="^line 2: 41 fields, expected 40"):
        criteo.parse_lines([LINE, long, short])


def test_a_malformed_line_of_a_workers_share_is_named_by_its_number_in_the_file(tmp_path, both_kernel_paths):
    path = tmp_path / "part.tsv"
    path.write_text(LINE * 5 + "1\tnot-a-number\n" + LINE)
    with pytest.raises(criteo.CriteoFormatError, match=f"^{path}: line 6: 2 fields"):
        list(criteo.batches(path, 2, skip=1, every=2))  # this worker reads lines 2, 4, 6


def test_lines_are_numbered_within_their_own_file(tmp_path, both_kernel_paths):
    first, second = tmp_path / "a.tsv", tmp_path / "b.tsv"
    first.write_text(LINE * 6)
    second.write_bytes(LINE.encode() + b"\xff" + LINE.encode() * 2)
    with pytest.raises(criteo.CriteoFormatError) as caught:
        list(criteo.array_batches([first, second], 4))  # the batch holding the bad line spans both files
    assert (caught.value.path, caught.value.line) == (str(second), 2)
    assert str(caught.value).startswith(f"{second}: line 2: field 1 (label): not UTF-8 (byte 0xff at column 1)")


def test_blank_lines_are_skipped_but_counted(tmp_path, both_kernel_paths):
    path = tmp_path / "gaps.tsv"
    path.write_text(LINE + "\n" + "  \r\n" + LINE + line(label="3"))
    with pytest.raises(criteo.CriteoFormatError, match=f"^{path}: line 5: field 1"):
        list(criteo.array_batches(path, 10))
    assert [len(b[2]) for b in criteo.array_batches([LINE, b"\n", b"  \r\n", LINE], 10)] == [2]


@pytest.mark.parametrize("skip, every", [(2, 2), (-1, 2), (0, 0)])
def test_a_share_outside_the_workers_is_refused(skip, every):
    with pytest.raises(criteo.InvalidArgumentError, match="0 <= skip < every"):
        list(criteo.batches([LINE], 1, skip=skip, every=every))


def test_a_batch_size_below_one_is_refused():
    with pytest.raises(criteo.InvalidArgumentError, match="batch_size"):
        list(criteo.array_batches([LINE], 0))


# ---- What good lines read as ----

def test_integers_are_read_whole_never_cut(both_kernel_paths):
    counts = ["000000000000000000012", "9223372036854775807", "-9223372036854775808", "-0", "00", "-17",
              "1234567890123456789"]
    dense, _, _ = criteo.parse_lines([line(counts=counts)])
    expected = [math.log1p(12), math.log1p(2 ** 63 - 1), 0.0, 0.0, 0.0, 0.0, math.log1p(1234567890123456789)]
    np.testing.assert_array_equal(dense[0, :len(counts)], np.float32(expected))


def test_files_with_windows_line_ends_read_as_with_unix_ones(tmp_path, both_kernel_paths):
    unix, windows = tmp_path / "unix.tsv", tmp_path / "windows.tsv"
    lines = [line(values=[f"{k:08x}"] * 26) for k in range(5)]
    unix.write_text("".join(lines))
    windows.write_bytes("".join(lines).replace("\n", "\r\n").encode())
    for a, b in zip(*(next(criteo.array_batches(path, 8)) for path in (unix, windows))):
        np.testing.assert_array_equal(a, b)


def test_a_file_without_a_last_newline_goes_on_in_the_next_file(tmp_path, both_kernel_paths):
    first, second = tmp_path / "a.tsv", tmp_path / "b.tsv"
    first.write_text(LINE + line(counts=["5"]).rstrip("\n"))
    second.write_text(line(counts=["6"]))
    dense, _, labels = next(criteo.array_batches([first, second], 8))
    assert len(labels) == 3 and dense[:, 0].tolist() == pytest.approx([math.log1p(3), math.log1p(5), math.log1p(6)])


def test_sharding_counts_lines_across_files(tmp_path, both_kernel_paths):
    first, second = tmp_path / "a.tsv", tmp_path / "b.tsv"
    first.write_text("".join(line(counts=[str(k)]) for k in range(5)))
    second.write_text("".join(line(counts=[str(k)]) for k in range(5, 9)))
    batches = list(criteo.array_batches([first, second], 2, skip=1, every=3))  # lines 1, 4, 7 of the 9
    dense = np.concatenate([dense[:, 0] for dense, _, _ in batches])
    np.testing.assert_array_equal(dense, np.log1p(np.float64([1, 4, 7])).astype(np.float32))


def test_non_ascii_utf8_values_are_values(both_kernel_paths):
    _, sparse, _ = criteo.parse_lines([line(values=["café"]), line(values=["cafe"]), line(values=["café"])])
    assert sparse[0, 0] == sparse[2, 0] != sparse[1, 0]


# ---- The hash: whole values, and the ids short values had before ----

MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """The murmur3 finalizer, from its definition."""
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK64
    return x ^ (x >> 33)


def words(value: bytes, count: int) -> tuple[int, ...]:
    return struct.unpack(f"={count}Q", value.ljust(8 * count, b"\0"))


def id_before(feature: int, value: bytes) -> int:
    """An id as the reader made it before whole values were hashed (their first 16 bytes only)."""
    w0, w1 = words(value[:16], 2)
    return np.int64(np.uint64((mix64(w0 ^ mix64(w1)) & ((1 << 56) - 1)) | feature << 56))


def id_documented(feature: int, value: bytes) -> int:
    """An id as the module docstring defines it."""
    w = words(value, max(2, -(-len(value) // 8)))
    h = mix64(w[0] ^ mix64(w[1]))
    if len(value) > 16:
        for word in w[2:]:
            h = mix64(h ^ word)
        h = mix64(h ^ len(value))
    return np.int64(np.uint64((h & ((1 << 56) - 1)) | feature << 56))


SHORT = ["", "a", "0000000a", "68fd1e64", "0123456789abcdef", "fifteen-bytes!!", "é", "日本語"]
LONG = ["0123456789abcdefX", "0123456789abcdefY", "0123456789abcdef" + "x" * 8, "0123456789abcdef" + "x" * 9,
        "a-value-longer-than-sixteen-bytes", "a-value-longer-than-sixteen-bytez", "日本語のとても長いカテゴリ値"]


def test_values_of_16_bytes_or_fewer_keep_their_ids(both_kernel_paths):
    values = (SHORT * 4)[:26]
    _, sparse, _ = criteo.parse_lines([line(values=values)])
    assert sparse[0].tolist() == [id_before(f, v.encode()) for f, v in enumerate(values)]


def test_whole_values_are_hashed_as_documented(both_kernel_paths):
    values = (LONG * 4)[:26]
    _, sparse, _ = criteo.parse_lines([line(values=values)])
    assert sparse[0].tolist() == [id_documented(f, v.encode()) for f, v in enumerate(values)]
    assert LONG[0][:16] == LONG[1][:16] and sparse[0, 0] >> 56 == 0 and sparse[0, 1] >> 56 == 1
    assert id_before(0, LONG[0].encode()) == id_before(0, LONG[1].encode())  # they collided before
    assert criteo.parse_lines([line(values=[LONG[1]])])[1][0, 0] != sparse[0, 0]  # not now


def test_long_values_sharing_a_prefix_get_different_ids(both_kernel_paths):
    prefix = "0123456789abcdef" * 3
    _, sparse, _ = criteo.parse_lines([line(values=[prefix + "1"]), line(values=[prefix + "2"]),
                                       line(values=[prefix]), line(values=[prefix[:16]])])
    assert len(set(sparse[:, 0].tolist())) == 4


# ---- The two parsers agree ----

TRICKY = [
    LINE,
    LINE.replace("\t3\t", "\t-7\t", 1),  # a negative count reads as 0
    LINE.replace("0000000a", "a-value-longer-than-sixteen-bytes"),
    LINE.replace("0000000a", "x" * 3000),
    LINE.replace("\t3\t", "\t1234567890123456789\t", 1),
    LINE.replace("\t3\t", "\t000000000000000000000000000000012\t", 1),
    LINE.replace("0000000a", "caf\u00e9"),  # not ASCII
    LINE.replace("0000000a", "\ud800"),  # a lone surrogate: not UTF-8 once encoded
    LINE.replace("0000000a", "tab\rinside"),  # a "\r" inside a line is part of its value
    LINE.rstrip("\n") + "\r\n",  # Windows line end
    LINE.rstrip("\n") + "\r",
    LINE.rstrip("\n"),  # a last line without its newline
    LINE + LINE,  # two lines given as one
    *[bad for bad, _, _ in BAD],
]


@pytest.mark.parametrize("index", range(len(TRICKY)))
def test_the_c_parser_and_numpy_agree_line_by_line(index, monkeypatch):
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
        assert fast == plain and fast.startswith("line 2: ")
    else:
        for a, b in zip(fast, plain):
            np.testing.assert_array_equal(a, b)


UTF8_EDGES = [b"\xc2\x80", b"\xdf\xbf", b"\xe0\xa0\x80", b"\xef\xbf\xbf", b"\xf0\x90\x80\x80", b"\xf4\x8f\xbf\xbf",
              b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xed\x9f\xbf", b"\xf0\x80\x80\x80",
              b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xe2\x82", b"\x80", b"\xff", b"\xf0\x9f\x98"]


def test_the_c_parser_takes_utf8_exactly_as_python_decodes_it(monkeypatch):
    if kernels.KERNELS is None:
        pytest.skip("C kernels not built")
    rng = np.random.default_rng(7)
    values = UTF8_EDGES + [bytes(rng.choice([0x41, 0x80, 0x9f, 0xa0, 0xbf, 0xc2, 0xe0, 0xed, 0xf0, 0xf4, 0xf5],
                                            rng.integers(1, 6)).astype(np.uint8)) for _ in range(400)]
    for value in values:
        data = line(values=["VALUE"]).encode().replace(b"VALUE", value)
        try:
            value.decode("utf-8")
            utf8 = True
        except UnicodeDecodeError:
            utf8 = False
        assert (criteo._parse_c(data, 1) is not None) == utf8, value
        with monkeypatch.context() as patch:
            patch.setattr(kernels, "KERNELS", None)
            try:
                numpy_takes = criteo.parse_lines([data]) is not None
            except criteo.CriteoFormatError:
                numpy_takes = False
        assert numpy_takes == utf8, value


def test_the_c_parser_takes_every_good_line_and_stops_at_every_bad_one():
    if kernels.KERNELS is None:
        pytest.skip("C kernels not built")
    good = [LINE, TRICKY[1], TRICKY[2], TRICKY[3], TRICKY[4], TRICKY[5], TRICKY[6], TRICKY[8], TRICKY[9]]
    data = "".join(good).encode()
    assert criteo._parse_c(data, len(good)) is not None
    for bad, _, _ in BAD + BAD_BYTES:
        bad = bad if isinstance(bad, bytes) else bad.encode()
        assert criteo._parse_c(LINE.encode() + bad, 2) is None, bad[:60]
