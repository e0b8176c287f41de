"""What a name may be: one rule for every name a request brings and a checkpoint holds.

A group, variable (part) or table name travels in a frame's header, lands in a shard's state, and
is written into checkpoint files (tensor keys ``dense/<group>/<part>`` and ``table/<table>/<key>``
and the metadata's JSON), log lines and metric labels. A name that one end accepts and the other
refuses poisons every checkpoint after it, so the PS (at decoding of Register and RegisterTable),
the checkpoint writer and the checkpoint reader all apply `name_problem`:

- text: a str of 1 to MAX_CHARS characters (the frame codec has already refused bytes that are not
  strict UTF-8 and escapes of lone surrogates; a surrogate here is refused again);
- no control character (Unicode category Cc: C0, DEL, C1), no line or paragraph separator
  (U+2028, U+2029), no bidirectional override or isolate (U+202A-U+202E, U+2066-U+2069): a name
  must print as what it is, on one line;
- no ``/``: it separates a checkpoint tensor key's fields, so ``g/w`` + ``b`` and ``g`` + ``w/b``
  would be one key.

Every other string that reaches checkpoint metadata (inside an optimizer spec, an initializer, a
row policy) obeys `text_problem`: the same rule, ``/`` allowed. A part named ``var[lo:hi]`` holds
rows lo..hi of its variable (client/placement.py): `part_problem` checks that its tensor agrees.
Checkpoint names are ``ckpt-`` and nine ASCII digits (`checkpoint_name_problem`), and a worker index
(a position's key in a checkpoint) has at most nine digits (`worker_problem`).

Each ``*_problem`` function returns why its argument is not valid, or None; `check_name` raises.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from typing import Any

from paramserver.base.errors import InvalidArgumentError

MAX_CHARS = 256  # characters of a name (at most 1 KiB of UTF-8)
SEPARATOR = "/"  # a checkpoint tensor key's separator: never inside a name
MAX_WORKER = 999_999_999  # a checkpoint keys each worker's position by its index in at most 9 digits
MAX_DEPTH = 16  # nesting of a spec's JSON checked for strings: far above any optimizer spec or policy
# line and paragraph separators and the bidirectional overrides and isolates: not category Cc, but they
# break a log line or make a name display as another
_UNPRINTABLE = frozenset("\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_SPLIT = re.compile(r"(.*)\[(\d+):(\d+)\]")  # as checkpoint/restore.py reads a part name
_CHECKPOINT = re.compile(r"ckpt-[0-9]{9}")  # ASCII digits: \d would take any script's digits


def text_problem(text: Any) -> str | None:
    """Why `text` is not text a checkpoint can hold (1 to MAX_CHARS characters, printable on one
    line, no surrogate), or None."""
    if not isinstance(text, str):
        return f"must be a string, not {type(text).__name__}"
    if not 0 < len(text) <= MAX_CHARS:
        return f"must be 1 to {MAX_CHARS} characters (it has {len(text)})"
    for at, char in enumerate(text):
        why = _char_problem(char)
        if why:
            return f"must not hold {why} (U+{ord(char):04X} at character {at})"
    return None


def _char_problem(char: str) -> str | None:
    code = ord(char)
    if 0x20 <= code < 0x7F:  # printable ASCII: the common case, decided at once
        return None
    if 0xD800 <= code <= 0xDFFF:
        return "a lone surrogate (not UTF-8 text)"
    if char in _UNPRINTABLE or unicodedata.category(char) == "Cc":
        return "control characters"
    return None


def name_problem(name: Any) -> str | None:
    """Why `name` is not a group, variable or table name (`text_problem`, and no SEPARATOR), or None."""
    why = text_problem(name)
    if why is None and SEPARATOR in name:
        return f"must not hold {SEPARATOR!r} (it separates the fields of a checkpoint's tensor names)"
    return why


def check_name(name: Any, what: str) -> str:
    """`name`, or InvalidArgumentError naming `what` ("group", "table 't' part") and the problem."""
    why = name_problem(name)
    if why:
        raise InvalidArgumentError(f"{what} {why}, got {show(name)}")
    return name


def name_value(name: str) -> str:
    """`name` or a ValueError (InvalidArgumentError) saying why: a validator for schemas (pydantic's
    AfterValidator) over names read back from a checkpoint."""
    why = name_problem(name)
    if why:
        raise InvalidArgumentError(f"not a name: {why}")
    return name


def strings_problem(value: Any) -> str | None:
    """Why a JSON value (an optimizer spec, an initializer, a row policy) holds a key or string that
    is not `text_problem`-valid, naming where; or None."""
    return _strings(value, "", 0)


def _strings(value: Any, where: str, depth: int) -> str | None:
    if depth > MAX_DEPTH:
        return f"nests more than {MAX_DEPTH} levels deep"
    if isinstance(value, str):
        why = text_problem(value)
        return f"holds a string{where and ' at ' + where} that {why}" if why else None
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, dict):
        items = value.items()
        for key in value:
            why = text_problem(key)
            if why:
                return f"holds a key{where and ' in ' + where} that {why}"
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        why = _strings(item, f"{where}[{key!r}]", depth + 1)
        if why:
            return why
    return None


def split_part(part: str) -> tuple[str, int, int] | None:
    """(variable, lo, hi) of a part named ``var[lo:hi]`` (rows lo..hi of the variable), None for
    a whole variable."""
    match = _SPLIT.fullmatch(part)
    return (match.group(1), int(match.group(2)), int(match.group(3))) if match else None


def part_problem(part: Any, shape: tuple[int, ...]) -> str | None:
    """Why `part`, the name of a tensor of `shape` registered as a variable's part, cannot be
    written and restored, or None: a name, and a ``var[lo:hi]`` part holds hi - lo rows."""
    why = name_problem(part)
    if why:
        return why
    split = split_part(part)
    if split is not None:
        _, lo, hi = split
        if not shape or hi <= lo or shape[0] != hi - lo:
            return f"names rows {lo}..{hi} of a variable, and its tensor has shape {tuple(shape)}"
    return None


def parts_problem(parts: dict[str, tuple[int, ...]]) -> str | None:
    """Why the parts one group registers on a shard (name -> shape) cannot be restored together,
    or None: each a `part_problem`-valid part, and a variable's parts never overlap (nor is a
    variable both whole and split)."""
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for part, shape in parts.items():
        why = part_problem(part, shape)
        if why:
            return f"part {show(part)} {why}"
        var, lo, hi = split_part(part) or (part, -1, -1)  # a whole variable overlaps any other part of it
        ranges.setdefault(var, []).append((lo, hi, part))
    for var, pieces in ranges.items():
        pieces.sort()
        for (lo, hi, first), (next_lo, _, second) in zip(pieces, pieces[1:]):
            if lo < 0 or next_lo < hi:
                return f"parts {show(first)} and {show(second)} overlap (both hold rows of variable {show(var)})"
    return None


def worker_problem(worker: int | None) -> str | None:
    """Why a worker index from the wire cannot be one a checkpoint names (its positions are keyed by
    up to 9 digits), or None. A negative one is the shard's to refuse (it says so)."""
    return None if worker is None or worker <= MAX_WORKER else f"must be at most {MAX_WORKER}"


def checkpoint_name_problem(name: Any) -> str | None:
    """Why `name` is not a checkpoint's name (``ckpt-`` and nine ASCII digits), or None."""
    if isinstance(name, str) and _CHECKPOINT.fullmatch(name):
        return None
    return "is not a checkpoint name (ckpt- and 9 digits 0-9)"


def checkpoint_name_value(name: str) -> str:
    """`name` or a ValueError (InvalidArgumentError) saying why: `name_value` for checkpoint names."""
    why = checkpoint_name_problem(name)
    if why:
        raise InvalidArgumentError(why)
    return name


def show(value: Any) -> str:
    """`value` for an error message: its repr, ASCII only (escapes show what a name really holds), cut."""
    text = ascii(value)
    return text if len(text) <= 120 else text[:117] + "..."
