"""A script's description of its data as splits (data/splits.py), and Criteo files split by byte
range (criteo_splits.split_batches): every line in exactly one split, the splits in order giving what
`criteo.batches` gives."""

import pytest
import torch
from tests.criteo_lines import LINE, line

from paramserver.base.errors import InvalidArgumentError
from paramserver.data import criteo, criteo_splits
from paramserver.data.splits import Splits, range_of

# ---- Splits ------------------------------------------------------------------------------------


def numbered(split, epoch, count=5):
    return [(epoch, split, batch) for batch in range(count)]


def test_a_split_s_batches_resume_at_a_position():
    splits = Splits(3, numbered)
    assert len(splits) == 3
    assert list(splits.batches(2, 1)) == numbered(2, 1)
    assert list(splits.batches(2, 1, 3)) == [(1, 2, 3), (1, 2, 4)]
    assert list(splits.batches(0, 0, 5)) == []  # at its end: nothing left, and no error


def test_a_position_past_a_split_s_end_is_refused_when_reached():
    batches = Splits(1, numbered).batches(0, 0, 6)
    with pytest.raises(InvalidArgumentError, match="split 0 of epoch 0 has 5 batches, fewer than its position 6"):
        next(batches)


def test_ranges_cover_every_item_once_in_near_equal_parts():
    for total, n in ((10, 3), (2, 5), (0, 1), (1000, 7)):
        parts = [range_of(total, n, k) for k in range(n)]
        assert [i for start, stop in parts for i in range(start, stop)] == list(range(total))
        assert max(stop - start for start, stop in parts) - min(stop - start for start, stop in parts) <= 1
    calls = []
    splits = Splits.ranges(10, 3, lambda start, stop, epoch: calls.append((start, stop, epoch)) or [start])
    assert [list(splits.batches(k, 4)) for k in range(3)] == [[0], [3], [6]]
    assert calls == [(0, 3, 4), (3, 6, 4), (6, 10, 4)]


def test_ranges_with_a_batch_size_seek_instead_of_reading_and_give_the_same_batches():
    read = []

    def rows(start, stop, epoch):  # in order, 2 items a batch
        read.append(start)
        return [list(range(at, min(at + 2, stop))) for at in range(start, stop, 2)]

    seeking, reading = Splits.ranges(23, 2, rows, batch_size=2), Splits.ranges(23, 2, rows)
    for position in range(7):  # split 1 is items 11 .. 22: 6 batches
        assert list(seeking.batches(1, 0, position)) == list(reading.batches(1, 0, position))
    for splits in (seeking, reading):
        with pytest.raises(InvalidArgumentError, match="has 6 batches, fewer than its position 7"):
            list(splits.batches(1, 0, 7))
    read.clear()
    assert list(seeking.batches(1, 0, 3)) == [[17, 18], [19, 20], [21, 22]]
    assert read == [17]  # started at item 11 + 3 * 2, nothing before it read


def test_files_are_one_split_each_in_order(tmp_path):
    paths = [tmp_path / "b.tsv", tmp_path / "a.tsv"]
    splits = Splits.files(paths, lambda path, epoch: [(path.name, epoch)])
    assert len(splits) == 2 and list(splits.batches(1, 3)) == [("a.tsv", 3)]
    assert list(Splits.files(str(paths[0]), lambda path, epoch: [path]).batches(0, 0)) == [str(paths[0])]


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: Splits(0, numbered), "num_splits"),
        (lambda: Splits(1.0, numbered), "num_splits"),
        (lambda: Splits((1 << 20) + 1, numbered), "num_splits"),
        (lambda: Splits(2, "not a function"), "batches_of must be a function"),
        (lambda: Splits(2, numbered, batches_from=3), "batches_from must be a function"),
        (lambda: Splits.ranges(-1, 2, numbered), "total_items"),
        (lambda: Splits.ranges(10, 2, numbered, batch_size=0), "batch_size"),
        (lambda: Splits.ranges(10, 2, None), "batches_of_range must be a function"),
        (lambda: Splits.files([], numbered), "non-empty list of file paths"),
        (lambda: Splits.files(3, numbered), "non-empty list of file paths"),
        (lambda: Splits.files(["a", 3], numbered), r"paths\[1\] must be a file path"),
        (lambda: Splits.files(["a", ""], numbered), r"paths\[1\] must be a file path"),
        (lambda: Splits.files(["a"], None), "batches_of_file must be a function"),
        (lambda: Splits(2, numbered).batches(2, 0), "split"),
        (lambda: Splits(2, numbered).batches(0, -1), "epoch"),
        (lambda: Splits(2, numbered).batches(0, 0, -1), "position"),
        (lambda: Splits(2, numbered).batches(0, 0, True), "position"),
    ],
)
def test_bad_arguments_are_refused_naming_them(make, fragment):
    with pytest.raises(InvalidArgumentError, match=fragment):
        make()


# ---- Criteo files split by byte range ------------------------------------------------------------


def numbered_line(index, ending="\n"):
    """A good line that says which it is: I2 = index (dense), C1 = its hex (sparse)."""
    return line(counts=["3", str(index)], values=[f"{index:08x}"]).replace("\n", ending)


def write_files(tmp_path):
    """Files of numbered lines with "\\r\\n" ends, blank lines, no final newline, and an empty file."""
    texts, index = [], 0

    def take(count, ending="\n"):
        nonlocal index
        lines = [numbered_line(index + k, ending) for k in range(count)]
        index += count
        return "".join(lines)

    texts.append(take(7))
    texts.append(take(5, "\r\n"))
    texts.append("\n" + take(3) + "\r\n" + "  \n" + take(4) + "\n")  # blank lines, leading too
    texts.append("")
    texts.append(take(6).rstrip("\n"))  # no newline at its end
    texts.append(take(1).rstrip("\n"))  # a one-line file without newline, right after another
    paths = []
    for number, text in enumerate(texts):
        path = tmp_path / f"part-{number}.tsv"
        path.write_bytes(text.encode())
        paths.append(path)
    return paths, index


def concatenated(batches):
    batches = list(batches)
    if not batches:
        return torch.empty(0, 13), torch.empty(0, 26, dtype=torch.int64), torch.empty(0)
    return tuple(torch.cat(parts) for parts in zip(*batches))


def assert_same(got, expected):
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_the_splits_in_order_are_the_files_line_for_line(tmp_path, batch_size, both_kernel_paths):
    paths, count = write_files(tmp_path)
    expected = concatenated(criteo.batches(paths, batch_size, parse_ahead=0))
    assert expected[0][:, 1].tolist() == pytest.approx(torch.log1p(torch.arange(count).float()).tolist())
    size = sum(path.stat().st_size for path in paths)
    for n in (1, 2, 3, 5, 8, count - 1, count + 9, 97, size, size + 3):
        per_split = [list(criteo_splits.split_batches(paths, batch_size, k, n, parse_ahead=0)) for k in range(n)]
        for batches in per_split:  # every batch full but a split's last
            assert all(len(labels) == batch_size for _, _, labels in batches[:-1])
        assert_same(concatenated(b for batches in per_split for b in batches), expected)


def test_a_split_reads_its_own_bytes_only(tmp_path, monkeypatch):
    paths, _ = write_files(tmp_path)
    size, longest = sum(p.stat().st_size for p in paths), max(len(numbered_line(99, "\r\n")), 1)
    monkeypatch.setattr(criteo_splits, "_BLOCK_BYTES", 1)  # a line a read: what is read is then what is needed
    read = []
    real_open = open

    class Counting:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def seek(self, offset):
            return self.handle.seek(offset)

        def readline(self):
            data = self.handle.readline()
            read.append(len(data))
            return data

        def readlines(self, hint):
            lines = self.handle.readlines(hint)
            read.append(sum(map(len, lines)))
            return lines

    monkeypatch.setattr(criteo_splits, "open", lambda path, mode: Counting(real_open(path, mode)), raising=False)
    n = 6
    for k in range(n):
        read.clear()
        list(criteo_splits.split_batches(paths, 3, k, n, parse_ahead=0))
        part = (k + 1) * size // n - k * size // n
        assert sum(read) <= part + 2 * longest, f"split {k} read {sum(read)} bytes for its {part}"


def test_a_split_resumes_at_a_position_as_a_splits_read_and_dropped(tmp_path):
    paths, _ = write_files(tmp_path)
    n, size = 3, 2
    read = lambda k, e: criteo_splits.split_batches(paths, size, k, n, parse_ahead=0)
    seek = lambda k, e, p: criteo_splits.split_batches(paths, size, k, n, parse_ahead=0, position=p)
    dropping, skipping = Splits(n, read), Splits(n, read, seek)
    for k in range(n):
        count = len(list(read(k, 0)))
        assert count >= 3
        for position in range(count + 1):
            got, expected = list(skipping.batches(k, 0, position)), list(dropping.batches(k, 0, position))
            assert len(got) == count - position
            assert_same(concatenated(got), concatenated(expected))
        with pytest.raises(InvalidArgumentError, match=f"split {k} of 3 has {count} batches, fewer than its position"):
            list(skipping.batches(k, 0, count + 1))


def test_the_background_parser_gives_the_same_batches(tmp_path):
    paths, _ = write_files(tmp_path)
    for k in range(3):
        assert_same(
            concatenated(criteo_splits.split_batches(paths, 2, k, 3)),
            concatenated(criteo_splits.split_batches(paths, 2, k, 3, parse_ahead=0)),
        )


def test_a_bad_line_is_named_by_its_file_and_line_number(tmp_path, both_kernel_paths):
    good = tmp_path / "part-0.tsv"
    good.write_bytes(LINE.encode() * 5)
    bad = tmp_path / "part-1.tsv"
    lines = [numbered_line(k, "\r\n") for k in range(10)]
    lines[3] = "\r\n"  # a blank line counts as a line
    lines[6] = line(label="2").replace("\n", "\r\n")  # line 7
    bad.write_bytes("".join(lines).encode())
    with pytest.raises(criteo.CriteoFormatError) as expected:
        list(criteo.batches([good, bad], 4, parse_ahead=0))
    raised = 0
    for k in range(4):
        try:
            list(criteo_splits.split_batches([good, bad], 4, k, 4, parse_ahead=0))
        except criteo.CriteoFormatError as error:
            raised += 1
            assert (error.path, error.line, error.field, str(error)) == (
                str(bad),
                7,
                "label",
                str(expected.value),
            )
    assert raised == 1  # only the split that owns the line reads it


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        (([LINE], 4, 0, 1), "reads files"),
        (([], 4, 0, 1), "reads files"),
        ((3, 4, 0, 1), "reads files"),
        ((["x"], 0, 0, 1), "batch_size"),
        ((["x"], 4, 1, 1), "0 <= split < num_splits"),
        ((["x"], 4, -1, 2), "0 <= split < num_splits"),
        ((["x"], 4, 0, 0), "0 <= split < num_splits"),
        ((["x"], 4, 0, 1, 0, -1), "position"),
    ],
)
def test_bad_split_arguments_are_refused_at_the_call(arguments, fragment):
    with pytest.raises(InvalidArgumentError, match=fragment):
        criteo_splits.split_batches(*arguments)
