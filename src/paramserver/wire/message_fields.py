"""The machinery behind wire/messages.py: a frozen dataclass that is a frame's meta.

A message class declares its fields with type hints and `doc_field` (a short doc, a default);
`Message` gives it `to_meta()` and `from_meta()`, both driven by the hints, so no class has a
parser of its own. Types a field may have (the JSON a frame's header holds): int, float, str,
bool, Any, `X | None`, list[X], dict[str, X], and a NamedTuple of those (a JSON list of fixed
length, e.g. [table, ids, grads]).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, Self

from paramserver.base import names
from paramserver.base.errors import MalformedFrameError

_UNIONS = (typing.Union, types.UnionType)
M = typing.TypeVar("M", bound="Message")


def doc_field(doc: str, *, default: Any = dataclasses.MISSING, check: Callable[[Any], str | None] | None = None) -> Any:
    """A message field with its doc; a field with a default is optional (omitted from the meta at
    its default). `check(value)` returns why a well-typed value is still wrong, or None."""
    metadata = {"doc": doc, "check": check}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@typing.dataclass_transform(frozen_default=True, field_specifiers=(doc_field,))
def message(
    title: str, tensors: str = "", check_tensors: Callable[[dict[str, Any]], str | None] | None = None
) -> Callable[[type[M]], type[M]]:
    """Class decorator: a frozen dataclass named `title` in errors and docs ("PushPull request"),
    whose frame carries `tensors` (words, for the docs: tensors never travel in the meta).
    `check_tensors(tensors)` returns why a frame's tensors (name -> array) do not fit the message, or None."""

    def wrap(cls: type[M]) -> type[M]:
        cls.TITLE, cls.TENSORS, cls.DOC = title, tensors, cls.__dict__.get("__doc__") or ""
        cls.CHECK_TENSORS = staticmethod(check_tensors) if check_tensors is not None else None
        return dataclasses.dataclass(frozen=True)(cls)

    return wrap


def part_tensors(tensors: dict[str, Any]) -> str | None:
    """Why tensors named by part (a group's variables) cannot be registered and restored, or None:
    each name a name (base/names.py), a ``var[lo:hi]`` part of hi - lo rows, no two parts overlapping."""
    return names.parts_problem({name: tuple(array.shape) for name, array in tensors.items()})


class Field(NamedTuple):
    name: str
    hint: Any
    doc: str
    required: bool
    default: Any
    check: Callable[[Any], str | None] | None
    parse: Callable[[Any], Any]  # checks a value against `hint` (raises _Wrong)


class Message:
    """Base of every request and reply meta.

    `from_meta` accepts and ignores keys it does not know: a newer peer may add optional keys
    (the protocol's minor version), and an older one must still understand the rest.
    """

    TITLE: ClassVar[str] = ""
    TENSORS: ClassVar[str] = ""
    DOC: ClassVar[str] = ""  # the class's own docstring (a dataclass makes one up otherwise)
    CHECK_TENSORS: ClassVar[Callable[[dict[str, Any]], str | None] | None] = None

    def to_meta(self) -> dict[str, Any]:
        """The meta as plain JSON values, in field order; optional fields at their default are left out."""
        meta = {}
        for spec in fields_of(type(self)):
            value = getattr(self, spec.name)
            if spec.required or value != spec.default:
                meta[spec.name] = _plain(value)
        return meta

    @classmethod
    def from_meta(cls, meta: Any) -> Self:
        """The message in `meta` (a decoded frame's meta), every field's type checked; raises
        MalformedFrameError naming the message and the field."""
        if not isinstance(meta, dict):
            raise MalformedFrameError(f"{cls.TITLE}: meta must be an object, got {_show(meta)}")
        values = {}
        for spec in fields_of(cls):
            if spec.name not in meta:
                if spec.required:
                    raise MalformedFrameError(f"{cls.TITLE} needs {spec.name!r} ({describe(spec.hint)})")
                continue
            value = meta[spec.name]
            try:
                values[spec.name] = parsed = spec.parse(value)
            except _Wrong as wrong:
                raise MalformedFrameError(
                    f"{cls.TITLE}: {spec.name!r}{wrong.where} must be {wrong.expected}, got {_show(wrong.value)}"
                ) from None
            why = spec.check(parsed) if spec.check is not None else None
            if why:
                raise MalformedFrameError(f"{cls.TITLE}: {spec.name!r} {why}, got {_show(value)}")
        return cls(**values)

    @classmethod
    def from_frame(cls, meta: Any, tensors: dict[str, Any]) -> Self:
        """The message in a decoded frame: `from_meta`, then its tensors checked (the message's
        `check_tensors`); MalformedFrameError naming the message and what is wrong."""
        parsed = cls.from_meta(meta)
        why = cls.CHECK_TENSORS(tensors) if cls.CHECK_TENSORS is not None else None
        if why:
            raise MalformedFrameError(f"{cls.TITLE}: {why}")
        return parsed


def fields_of(cls: type) -> tuple[Field, ...]:
    """The fields of a message class, in order (computed once per class)."""
    return _fields_of(cls)  # passed as a `type`: mypy wrongly finds a type[Message] not Hashable


@functools.cache
def _fields_of(cls: type) -> tuple[Field, ...]:
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        factory = f.default_factory
        required, default = False, f.default
        if f.default is dataclasses.MISSING:
            required, default = (False, factory()) if callable(factory) else (True, None)  # no factory: MISSING
        found.append(
            Field(
                f.name,
                hints[f.name],
                f.metadata.get("doc", ""),
                required,
                default,
                f.metadata.get("check"),
                _parser(hints[f.name]),
            )
        )
    return tuple(found)


class _Wrong(Exception):
    def __init__(self, expected: str, value: Any, where: str = "") -> None:
        self.expected, self.value, self.where = expected, value, where


def _is_named_tuple(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, tuple) and hasattr(hint, "_fields")


@functools.cache
def _parser(hint: Any) -> Callable[[Any], Any]:
    """The function that checks a value against `hint` (floats from JSON integers become floats)
    and raises _Wrong, built once per type."""
    if hint is Any:
        return lambda value: value
    expected = describe(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in _UNIONS:
        (inner,) = [arg for arg in args if arg is not type(None)]
        inner_parse = _parser(inner)

        def optional(value: Any) -> Any:
            if value is None:
                return None
            try:
                return inner_parse(value)
            except _Wrong as wrong:
                if wrong.where or wrong.expected in _RANGES.values():  # say what exactly is wrong
                    raise
                raise _Wrong(expected, value) from None

        return optional
    if hint in _SCALARS:
        kinds, convert = _SCALARS[hint]

        def scalar(value: Any) -> Any:
            if isinstance(value, kinds) and (hint is bool or not isinstance(value, bool)):
                try:
                    converted = convert(value)
                except OverflowError:  # a JSON integer too large for a float
                    raise _Wrong(expected, value) from None
                if not _in_range(hint, converted):
                    raise _Wrong(_RANGES[hint], value)
                return converted
            raise _Wrong(expected, value)

        return scalar
    if _is_named_tuple(hint):
        items = [_parser(kind) for kind in typing.get_type_hints(hint).values()]

        def fixed(value: Any) -> Any:
            if not isinstance(value, list) or len(value) != len(items):
                raise _Wrong(expected, value)
            return hint(*(_inner(parse, item, i) for i, (parse, item) in enumerate(zip(items, value))))

        return fixed
    if origin is list:
        item_parse, names = _parser(args[0]), args[0] is str

        def listed(value: Any) -> Any:
            if not isinstance(value, list):
                raise _Wrong(expected, value)
            if names and all(type(item) is str for item in value):  # the common case, checked at once
                return list(value)
            return [_inner(item_parse, item, i) for i, item in enumerate(value)]

        return listed
    if origin is dict:
        item_parse = _parser(args[1])

        def mapped(value: Any) -> Any:
            if not isinstance(value, dict):
                raise _Wrong(expected, value)
            return {key: _inner(item_parse, item, key) for key, item in value.items()}

        return mapped
    raise TypeError(f"message field type {hint!r} is not supported")


_SCALARS: dict[Any, tuple[type | tuple[type, ...], Callable[[Any], Any]]] = {
    bool: (bool, bool),
    int: (int, int),
    float: ((int, float), float),
    str: (str, str),
}
_INT64 = 1 << 63
_RANGES = {int: "an integer in the int64 range", float: "a finite number"}


def _in_range(hint: Any, value: Any) -> bool:
    """Integers of the wire are int64 and numbers finite: what numpy and the peers can hold."""
    if hint is int:
        return -_INT64 <= value < _INT64
    if hint is float:
        return math.isfinite(value)
    return True


def _inner(parse: Callable[[Any], Any], value: Any, key: Any) -> Any:
    try:
        return parse(value)
    except _Wrong as wrong:
        raise _Wrong(wrong.expected, wrong.value, f"[{key!r}]" + wrong.where) from None


def describe(hint: Any) -> str:
    """A field type in words, for errors and docs."""
    if hint is Any:
        return "any value"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in _UNIONS:
        (inner,) = [arg for arg in args if arg is not type(None)]
        return f"{describe(inner)} or null"
    if _is_named_tuple(hint):
        return "[" + ", ".join(hint._fields) + "]"
    if origin is list:
        return f"a list of {_plural(args[0])}"
    if origin is dict:
        return "an object" if args[1] is Any else f"an object of {_plural(args[1])}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]


def _plural(hint: Any) -> str:
    words = describe(hint)
    plain = {
        "an integer": "integers",
        "a number": "numbers",
        "a string": "strings",
        "true or false": "booleans",
        "an object": "objects",
        "any value": "values",
    }
    return plain.get(words, words)


def _plain(value: Any) -> Any:
    """JSON-native copy: tuples (NamedTuples) as lists."""
    if isinstance(value, (list, tuple)):
        if all(type(item) in _ATOMS for item in value):  # the common case (names, ids): no recursion
            return list(value)
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


_ATOMS = frozenset({str, int, float, bool, type(None)})


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


# ---- docs/protocol.md's message tables -------------------------------------------------------
BEGIN = "<!-- BEGIN messages: generated by `python -m paramserver.wire.messages --write docs/protocol.md` -->"
END = "<!-- END messages -->"


def markdown(services: dict[str, dict[str, tuple[type[Message], type[Message]]]]) -> str:
    """The message tables of every method of every service, between the BEGIN and END markers."""
    lines = [BEGIN, ""]
    shown: set[type] = set()
    for service, methods in services.items():
        lines += [f"### Service `{service}`", ""]
        for method, (request, reply) in methods.items():
            lines += [f"#### `{method}`", ""] + ([request.DOC, ""] if request.DOC else [])
            for kind, cls in (("Request", request), ("Reply", reply)):
                lines += _table(kind, cls, cls in shown)
                shown.add(cls)
    return "\n".join(lines + [END])


def _table(kind: str, cls: type[Message], again: bool) -> list[str]:
    tensors = f"; tensors: {cls.TENSORS}" if cls.TENSORS else ""
    specs = fields_of(cls)
    if again or not specs:
        meta = "as above" if again and specs else "`{}`"
        return [f"{kind} `{cls.__name__}`: meta {meta}{tensors}.", ""]
    about = f" {cls.DOC}" if kind == "Reply" and cls.DOC else ""
    lines = [
        f"{kind} `{cls.__name__}`{tensors}.{about}",
        "",
        "| field | type | presence | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for spec in specs:
        presence = (
            "required"
            if spec.required
            else "optional"
            if spec.default is None
            else f"default `{json.dumps(_plain(spec.default))}`"
        )
        lines.append(f"| `{spec.name}` | {describe(spec.hint)} | {presence} | {spec.doc} |")
    return lines + [""]


def replaced(text: str, section: str) -> str:
    """`text` with its BEGIN..END section replaced by `section`."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError("the document has no BEGIN/END markers of the message tables")
    return text[:start] + section + text[end + len(END) :]


def main(services: dict) -> None:
    parser = argparse.ArgumentParser(description="Print (or write into a document) the message tables.")
    parser.add_argument("--write", metavar="DOC", help="replace the tables between the markers in DOC")
    parser.add_argument("--check", metavar="DOC", help="exit 1 if DOC's tables differ from the messages")
    args = parser.parse_args()
    section = markdown(services)
    for path in filter(None, (args.write, args.check)):
        with open(path, encoding="utf-8") as file:
            text = file.read()
        new = replaced(text, section)
        if args.check and new != text:
            sys.exit(f"{path}: the message tables differ from paramserver.wire.messages; run with --write")
        if args.write and new != text:
            with open(path, "w", encoding="utf-8") as file:
                file.write(new)
    if not (args.write or args.check):
        print(section)
