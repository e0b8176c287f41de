"""A streaming reader of Criteo's TSV format (the Display Advertising Challenge layout).

Each line: label, 13 integer features (I1-I13), 26 categorical features (C1-C26), tab
separated, ended by "\\n" or "\\r\\n" (or nothing, on a file's last line). Lines are read lazily,
a block at a time, from one or more files (or any iterable of lines, str or bytes), and each
batch is parsed in C (or with vectorized numpy where the extension is not built: the same
results, the same refusals), so a dataset larger than memory streams through quickly.

What a line must be; anything else is a bad line, refused with a CriteoFormatError (a
ValueError) that names the file, the line's number in that file (lines given directly: among
them) and the field; blank lines are skipped (and counted):
- valid UTF-8 (files are read as bytes, so an undecodable byte is a bad line like any other),
  with no NUL byte, and 40 fields;
- label: exactly "0" or "1" ("1.0", "2", "-1" are refused);
- integer feature: empty (missing), or -?[0-9]+ whose value fits in int64. Leading zeros are
  fine ("000000000000000000012" is 12); a value outside int64 is refused, never truncated;
- categorical feature: any text (Criteo's are 8 hex digits); empty is a value of its own.

A batch is (dense, sparse, labels): dense float32 (B, 13) = log(1 + max(x, 0)) with missing
as 0; sparse int64 (B, 26) = feature << 56 | (h & (2**56 - 1)), the feature index in the top
8 bits, so one shared table keeps the 26 features apart; labels float32 (B,).

h, the hash of a value's n UTF-8 bytes: with mix64 the murmur3 finalizer
(paramserver.tables.hash_index.mix64) and w0, w1, ... the bytes zero-padded to 8-byte words
read in native byte order (little-endian on x86 and ARM):
    h = mix64(w0 ^ mix64(w1))             -- the whole hash when n <= 16
    h = mix64(h ^ wk) for k = 2, 3, ...   -- n > 16: every further word,
    h = mix64(h ^ n)                      -- then the length.
Values of up to 16 bytes keep the ids they had when only a value's first 16 bytes were hashed
(checkpoints written then still find those rows). Longer values sharing their first 16 bytes
no longer share an id; their ids changed, so rows a checkpoint of that time holds for them are
not found again (they start fresh).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from paramserver.base import kernels
from paramserver.base.errors import InvalidArgumentError
from paramserver.base.hashing import mix64
from paramserver.data.background import BackgroundBatches
from paramserver.data.loader import BatchLoader

NUM_DENSE, NUM_SPARSE = 13, 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
FIELD_NAMES = ("label", *(f"I{k}" for k in range(1, NUM_DENSE + 1)), *(f"C{k}" for k in range(1, NUM_SPARSE + 1)))
_LOW56 = np.uint64((1 << 56) - 1)
_FEATURE = np.arange(NUM_SPARSE, dtype=np.uint64) << np.uint64(56)
PARSE_AHEAD = 4  # batches a background thread parses ahead of the loop by default
_BLOCK_BYTES = 1 << 20  # a file is read this much at a time: per-block Python work is then noise
_INTEGER = re.compile(rb"-?[0-9]+")
_INT64_DIGITS = 19  # more significant digits than this never fit (and int() of thousands is refused)

Segments = list[tuple[str | None, Sequence[int]]]  # (file, line numbers) of consecutive runs of a batch


class CriteoFormatError(ValueError):
    """A line that is not in Criteo's format. `path` is its file (None for lines given directly),
    `line` its number there (from 1), `field` the bad field's name (FIELD_NAMES; None when the
    line as a whole is bad, e.g. its field count)."""

    def __init__(
        self, message: str, path: str | None = None, line: int | None = None, field: str | None = None
    ) -> None:
        super().__init__(message)
        self.path, self.line, self.field = path, line, field

    def __reduce__(self):  # a loader process sends it pickled: keep the attributes
        return type(self), (str(self), self.path, self.line, self.field)


class _BadLine(Exception):
    """Line `index` of a batch is bad: `problem`, in field `field` (an index; None: the whole line)."""

    def __init__(self, index: int, field: int | None, problem: str) -> None:
        super().__init__(problem)
        self.index, self.field, self.problem = index, field, problem


def parse_lines(
    lines: Sequence[str | bytes], numbers: int | Sequence[int] = 1, path: str | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dense, sparse, labels) arrays of a list of lines (str, or bytes of UTF-8); a bad line raises
    CriteoFormatError naming `path` and its number (`numbers`: each line's, or the first's)."""
    numbers = range(numbers, numbers + len(lines)) if isinstance(numbers, int) else numbers
    return _parse_located(lines, [(path, numbers)])


def _parse_located(lines: Sequence[str | bytes], segments: Segments) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    try:
        return _parse(lines)
    except _BadLine as bad:
        raise _format_error(bad, *_locate(segments, bad.index)) from None


def _locate(segments: Segments, index: int) -> tuple[str | None, int | None]:
    """(file, line number) of a batch's index-th line."""
    for path, numbers in segments:
        if index < len(numbers):
            return path, numbers[index]
        index -= len(numbers)
    return None, None  # numbers given for fewer lines than parsed: the message names the field only


def _format_error(bad: _BadLine, path: str | None, number: int | None) -> CriteoFormatError:
    where = (f"{path}: " if path is not None else "") + (f"line {number}: " if number is not None else "")
    field = None if bad.field is None else FIELD_NAMES[bad.field]
    what = bad.problem if bad.field is None else f"field {bad.field + 1} ({field}): {bad.problem}"
    return CriteoFormatError(where + what, path, number, field)


def _parse(lines: Sequence[str | bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The C parser where built; numpy where not, and where C stops at a bad line (numpy names it)."""
    if not lines:
        return np.empty((0, NUM_DENSE), np.float32), np.empty((0, NUM_SPARSE), np.int64), np.empty(0, np.float32)
    if kernels.KERNELS is not None:
        parsed = _parse_c(_joined(lines), len(lines))
        if parsed is not None:
            return parsed
    return _parse_numpy([_encoded(line) for line in lines])


def _encoded(line: str | bytes) -> bytes:
    # surrogatepass: a lone surrogate becomes bytes that are not UTF-8, refused as such, by line
    return line if isinstance(line, bytes) else line.encode("utf-8", "surrogatepass")


def _joined(lines: Sequence[str | bytes]) -> bytes:
    try:
        data = b"".join(cast(Sequence[bytes], lines))  # lines read from files: bytes
    except TypeError:  # lines given as str
        data = b"".join(map(_encoded, lines))
    return data if data.endswith(b"\n") else data + b"\n"


def _parse_c(data: bytes, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    if kernels.KERNELS is None:  # C kernels not built: the numpy parser parses (as `_parse` does)
        return None
    labels, dense = np.empty(n, np.float32), np.empty((n, NUM_DENSE), np.float32)
    sparse = np.empty((n, NUM_SPARSE), np.int64)
    done = kernels.KERNELS.ps_parse_criteo(
        data, len(data), n, kernels.ptr(labels), kernels.ptr(dense), kernels.ptr(sparse)
    )
    return (dense, sparse, labels) if done == n else None


def _parse_numpy(lines: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    bodies = [_body(line) for line in lines]
    _check_lines(bodies)
    table = np.array(b"\t".join(bodies).split(b"\t"), dtype=object).reshape(len(lines), NUM_FIELDS)
    labels, bad_labels = _labels(table[:, 0])
    dense, bad_counts = _counts(table[:, 1 : 1 + NUM_DENSE])
    bad = bad_labels | bad_counts
    if bad.any():
        _refuse_first(bodies, int(np.argmax(bad)))
    return dense, _hashes(table[:, 1 + NUM_DENSE :]), labels


def _body(line: bytes) -> bytes:
    """A line without its line end: "\\n", "\\r\\n" (as text mode read them before), or none."""
    line = line[:-1] if line.endswith(b"\n") else line
    return line[:-1] if line.endswith(b"\r") else line


def _check_lines(bodies: list[bytes]) -> None:
    """Refuses the first bad line unless all are UTF-8 without NUL bytes or line breaks, with 40 fields."""
    text = b"\n".join(bodies)  # the "\n"s keep a UTF-8 sequence from running on into the next line
    tabs = list(map(bytes.count, bodies, itertools.repeat(b"\t")))
    if (
        tabs.count(NUM_FIELDS - 1) != len(bodies)
        or text.count(b"\n") != len(bodies) - 1
        or b"\0" in text
        or not _utf8(text)
    ):
        _refuse_first(bodies, 0)


def _utf8(text: bytes) -> bool:
    if text.isascii():
        return True
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _refuse_first(bodies: list[bytes], start: int) -> None:
    """Raises _BadLine for the first bad line from `start` on (the vectorized checks found one)."""
    for index in range(start, len(bodies)):
        field, problem = _problem(bodies[index])
        if problem is not None:
            raise _BadLine(index, field, problem)
    raise _BadLine(start, None, "not in Criteo's format")  # the checks disagree: still never take it


def _problem(body: bytes) -> tuple[int | None, str | None]:
    """The first thing wrong with one line (without its line end): (field index or None, what), or (None, None)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return body.count(b"\t", 0, exc.start), f"not UTF-8 (byte 0x{body[exc.start]:02x} at column {exc.start + 1})"
    for byte, what in ((b"\0", "a NUL byte"), (b"\n", "a line break inside the line")):
        if byte in body:
            at = body.index(byte)
            return body.count(b"\t", 0, at), f"{what} at column {at + 1}"
    values = body.split(b"\t")
    if len(values) != NUM_FIELDS:
        return None, f"{len(values)} fields, expected {NUM_FIELDS}"
    if values[0] not in (b"0", b"1"):
        return 0, f"label {_shown(values[0])} is not 0 or 1"
    for field, value in enumerate(values[1 : 1 + NUM_DENSE], 1):
        if value and not _INTEGER.fullmatch(value):
            return field, f"{_shown(value)} is not an integer"
        if value and not _fits_int64(value):
            return field, f"{_shown(value)} does not fit in a 64-bit integer"
    return None, None


def _shown(value: bytes) -> str:
    """A value for a message: quoted, cut short (a bad line may be megabytes)."""
    text = value.decode("utf-8", "backslashreplace")
    return repr(text if len(text) <= 40 else text[:40] + "...")


def _fits_int64(value: bytes) -> bool:
    if len(value.lstrip(b"-").lstrip(b"0")) > _INT64_DIGITS:
        return False
    return -(1 << 63) <= int(value) < (1 << 63)


def _labels(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(labels, which are bad): exactly "0" or "1"."""
    text = _fixed(values, 2)
    ones = text == b"1"
    return ones.astype(np.float32), ~(ones | (text == b"0"))


def _counts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log1p(max(x, 0)) of the integer features, missing = 0; which lines have a bad one)."""
    text = _fixed(values.ravel(), 20)
    bad = ~_integer_syntax(text)
    text[bad | (text == b"")] = b"0"
    try:
        counts = text.astype(np.int64)
    except (OverflowError, ValueError):  # some value outside int64: find them one by one (a bad batch)
        outside = np.array([not _fits_int64(value) for value in text.tolist()])
        bad |= outside
        text[outside] = b"0"
        counts = text.astype(np.int64)
    dense = np.log1p(np.maximum(counts, 0)).astype(np.float32).reshape(values.shape)
    # a 2-D array's any(axis=1) is an array (numpy's stubs also allow the scalar of a 1-D one)
    return dense, cast(np.ndarray, bad.reshape(values.shape).any(axis=1))


def _fixed(values: np.ndarray, width: int) -> np.ndarray:
    """bytes objects as a NUL-padded bytes array, `width` wide, or as wide as the longest where that
    is longer (numpy would cut it). A fixed width is 3x faster to fill than numpy's own choice."""
    text = np.array(values, dtype=f"S{width}")
    full = np.flatnonzero(text.view(np.uint8).reshape(len(text), width)[:, -1])  # `width` bytes, or cut
    if full.size and max(map(len, values[full])) > width:
        text = np.array(values, dtype="S")
    return text


def _integer_syntax(text: np.ndarray) -> np.ndarray:
    """Which values of a fixed-width bytes array (NUL padded, no NUL inside) are -?[0-9]+ or empty."""
    chars = text.view(np.uint8).reshape(len(text), text.dtype.itemsize)
    digit = (chars >= ord("0")) & (chars <= ord("9"))
    minus = chars[:, 0] == ord("-")
    allowed = digit | (chars == 0)
    allowed[:, 0] |= minus
    digit_after_minus = digit[:, 1] if chars.shape[1] > 1 else np.zeros(len(text), bool)
    return allowed.all(axis=1) & (digit_after_minus | ~minus)


def _hashes(values: np.ndarray) -> np.ndarray:
    """The categorical features' ids: feature << 56 | the value's 56-bit hash (module docstring)."""
    hashed = _hash_values(_fixed(values.ravel(), 16))
    return ((hashed.reshape(values.shape) & _LOW56) | _FEATURE).view(np.int64)


def _hash_values(text: np.ndarray) -> np.ndarray:
    """The module docstring's h of each value of a fixed-width bytes array (NUL padded, no NUL inside)."""
    width = max(16, -(-text.dtype.itemsize // 8) * 8)
    padded = text if text.dtype.itemsize == width else text.astype(f"S{width}")
    words = padded.view(np.uint64).reshape(len(text), width // 8)
    hashed = _mix(words[:, 0] ^ _mix(words[:, 1]))
    longer = np.flatnonzero(words[:, 2:].any(axis=1))  # over 16 bytes: a value has no NUL bytes
    if longer.size:
        hashed[longer] = _fold(words[longer], np.char.str_len(text[longer]).astype(np.uint64), hashed[longer])
    return hashed


def _fold(words: np.ndarray, lengths: np.ndarray, hashed: np.ndarray) -> np.ndarray:
    """The hash of values over 16 bytes, from that of their first 16: each further word, then the length."""
    for k in range(2, words.shape[1]):
        more = lengths > 8 * k
        hashed[more] = _mix(hashed[more] ^ words[more, k])
    return _mix(hashed ^ lengths)


def _mix(words: np.ndarray) -> np.ndarray:
    return mix64(words.view(np.int64))


def _is_path(item) -> bool:
    return isinstance(item, Path) or (isinstance(item, str) and "\t" not in item)


def _blocks(source, given_block: int) -> Iterator[tuple[str | None, int, list[bytes]]]:
    """(file, number of the first line, lines as bytes) of consecutive lines of `source`, in order.
    Lines given directly (no file) are numbered among themselves, in blocks of `given_block`."""
    given: list[bytes] = []
    number = 1
    items: Iterable[Any] = [source] if isinstance(source, (str, Path)) else source  # paths, and lines
    for item in items:
        if _is_path(item):
            if given:
                yield None, number, given
                number, given = number + len(given), []
            yield from _file_blocks(str(item))
            continue
        given.append(_encoded(item))
        if len(given) == given_block:
            yield None, number, given
            number, given = number + len(given), []
    if given:
        yield None, number, given


def _file_blocks(path: str) -> Iterator[tuple[str, int, list[bytes]]]:
    """A file's lines, read as bytes (decoding is the parser's: a bad byte is then a bad line, named)."""
    with open(path, "rb") as handle:
        number = 1
        while lines := handle.readlines(_BLOCK_BYTES):
            if not lines[-1].endswith(b"\n"):  # the file's last line: one batch may go on in the next file
                lines[-1] += b"\n"
            yield path, number, lines
            number += len(lines)


def _kept(
    blocks: Iterable[tuple[str | None, int, list[bytes]]], skip: int, every: int
) -> Iterator[tuple[str | None, Sequence[int], list[bytes]]]:
    """(file, line numbers, lines) of every `every`-th line from `skip` on, counted across all blocks,
    without blank lines."""
    index = 0  # of the block's first line among all lines
    numbers: Sequence[int]
    for path, first, lines in blocks:
        start = (skip - index) % every
        index += len(lines)
        kept, numbers = lines[start::every], range(first + start, first + len(lines), every)
        if not all(kept) or any(map(bytes.isspace, kept)):  # blank lines: rare, and checked at C speed
            kept, numbers = _without_blanks(kept, numbers)
        if kept:
            yield path, numbers, kept


def _without_blanks(lines: list[bytes], numbers: Sequence[int]) -> tuple[list[bytes], list[int]]:
    pairs = [(number, line) for number, line in zip(numbers, lines) if line.strip()]
    return [line for _, line in pairs], [number for number, _ in pairs]


def _batched(
    kept: Iterable[tuple[str | None, Sequence[int], list[bytes]]], batch_size: int
) -> Iterator[tuple[list[bytes], Segments]]:
    """Batches of batch_size lines (the last may be shorter), each with its segments (file, line numbers)."""
    lines: list[bytes] = []
    segments: Segments = []
    for path, numbers, block in kept:
        at = 0
        while at < len(block):
            take = min(batch_size - len(lines), len(block) - at)
            lines += block[at : at + take]
            segments.append((path, numbers[at : at + take]))
            at += take
            if len(lines) == batch_size:
                yield lines, segments
                lines, segments = [], []
    if lines:
        yield lines, segments


def batches(
    source, batch_size: int, skip: int = 0, every: int = 1, prefetch: int = 0, parse_ahead: int = PARSE_AHEAD
) -> Iterator[tuple]:
    """Batches of (dense, sparse, labels) torch tensors from files or lines; `skip`/`every` keep every
    `every`-th line starting at `skip` (a worker's shard: skip=worker_index, every=num_workers),
    counting the lines of all files in order; blank lines are skipped.

    By default a background thread ("parse-criteo") parses up to `parse_ahead` batches ahead of
    the loop (data/background.py); `parse_ahead=0` parses in the loop itself. prefetch > 0 parses
    in a loader process instead, which keeps up to that many batches ready
    (paramserver.data.loader); `source` must then be file paths.
    """
    if prefetch:
        paths = [str(p) for p in ([source] if isinstance(source, (str, Path)) else source)]
        loader = BatchLoader(array_batches, paths, batch_size, skip, every, depth=prefetch)
        yield from (_tensors(batch) for batch in loader)
    elif parse_ahead:
        yield from BackgroundBatches(
            lambda: map(_tensors, array_batches(source, batch_size, skip, every)), parse_ahead, name="parse-criteo"
        )
    else:
        yield from map(_tensors, array_batches(source, batch_size, skip, every))


def array_batches(source, batch_size: int, skip: int = 0, every: int = 1) -> Iterator[tuple[np.ndarray, ...]]:
    """As `batches`, as numpy arrays, in this process."""
    if not (isinstance(every, int) and every >= 1 and isinstance(skip, int) and 0 <= skip < every):
        raise InvalidArgumentError(f"line sharding needs 0 <= skip < every, got skip={skip!r}, every={every!r}")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise InvalidArgumentError(f"batch_size must be a positive integer, got {batch_size!r}")
    for lines, segments in _batched(_kept(_blocks(source, batch_size * every), skip, every), batch_size):
        yield _parse_located(lines, segments)


def _tensors(arrays) -> tuple:
    import torch  # here, so that a loader process parses without importing torch

    dense, sparse, labels = arrays
    return torch.from_numpy(dense), torch.from_numpy(np.ascontiguousarray(sparse)), torch.from_numpy(labels)
