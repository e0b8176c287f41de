"""The registry: every codec of this package, found by its modules, and the option's codec words parsed.

A module of paramserver.base.codecs whose name does not start with "_" holds one codec: one concrete
Codec subclass defined there. The modules are imported on first use, once (thread-safe: the import
lock orders concurrent first uses, and the result never changes).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from types import ModuleType

from paramserver.base.codecs._codec import NONE, Codec, Uncompressed
from paramserver.base.errors import InvalidArgumentError


def discover(package: ModuleType) -> dict[str, type[Codec]]:
    """The codecs of `package`'s modules, by kind (modules in name order). Raises TypeError when a
    module holds no codec or several, or two codecs share a kind: a codec module written wrong."""
    found: dict[str, type[Codec]] = {}
    for module_info in pkgutil.iter_modules(package.__path__):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{module_info.name}")
        classes = [
            value
            for value in vars(module).values()
            if isinstance(value, type)
            and issubclass(value, Codec)
            and value.__module__ == module.__name__
            and not inspect.isabstract(value)
        ]
        if len(classes) != 1:
            raise TypeError(f"codec module {module.__name__} must define one Codec subclass, found {len(classes)}")
        codec = classes[0]
        if codec.kind in found or codec.kind == NONE.kind:
            raise TypeError(f"codec {codec.kind!r} of {module.__name__} is defined twice")
        found[codec.kind] = codec
    return found


@functools.cache
def registered() -> dict[str, type[Codec]]:
    """Every codec of paramserver.base.codecs by kind: what a gradient's header may name. Not `none`."""
    return discover(importlib.import_module(__package__))


def usage() -> str:
    """The codec words of the option, e.g. "none, bf16, fp16, int8, topk:R"."""
    words = [NONE.kind, *(f"{kind}:{c.argument}" if c.argument else kind for kind, c in registered().items())]
    return ", ".join(words)


def parse(text: str) -> Codec:
    """The codec written `text` (`KIND` or `KIND:ARGUMENT`) in the `compression` option."""
    text = text.strip()
    kind, _, argument = text.partition(":")
    codec = Uncompressed if kind == NONE.kind else registered().get(kind)
    if codec is None:
        raise InvalidArgumentError(f"unknown compression codec {text!r} (one of {usage()})")
    return codec.from_argument(argument, text)
