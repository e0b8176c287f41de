"""Which gradients are compressed, and how: the `compression` option, parsed.

The option is one comma-separated list of `PATTERN=CODEC` rules, or a bare `CODEC` for every
gradient; the first rule whose pattern (fnmatch, e.g. `mlp.*`) matches a parameter's name
(`model.named_parameters()`) or a table's name wins, and a name no rule matches is sent as is.

A CODEC is `none` or a codec of base/codecs/ (`paramserver.base.codecs.usage()` lists them), with
its argument after a colon where it takes one (`topk:0.01`). A codec that is not for tables (its
`for_tables`) compresses dense variables only: a table skips its rules, see `codec_for_table`.

    "fp16"                                   every gradient as float16
    "mlp.*=int8,ctr.embedding=bf16"          two rules; the rest as is
    "auto"                                   chosen by each worker from its measured links (client/link.py)
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from paramserver.base.codecs import NONE, Codec, parse, registered
from paramserver.base.errors import InvalidArgumentError

__all__ = ["AUTO", "NONE", "Codec", "CompressionSpec", "parse"]

AUTO = "auto"


@dataclass(frozen=True)
class CompressionSpec:
    """The parsed `compression` option: ordered (pattern, codec) rules."""

    rules: tuple[tuple[str, Codec], ...] = ()
    auto: bool = False  # "auto": no rules; the worker chooses from its measured links (client/link.py)

    @classmethod
    def parse(cls, text: str) -> CompressionSpec:
        if text.strip() == AUTO:
            return cls(auto=True)
        rules = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            pattern, sep, codec = part.rpartition("=")
            if sep and not pattern.strip():
                raise InvalidArgumentError(f"compression rule {part!r} has an empty pattern")
            rules.append((pattern.strip() if sep else "*", parse(codec)))
        return cls(tuple(rules))

    def codec_for(self, name: str) -> Codec:
        """The codec of the parameter or table called `name` (NONE when no rule matches)."""
        for pattern, codec in self.rules:
            if fnmatch.fnmatchcase(name, pattern):
                return codec
        return NONE

    def codec_for_table(self, name: str) -> Codec:
        """The codec of table `name`'s row gradients. A rule whose codec is not for tables (topk) is for
        dense variables: a table skips it (the next matching rule decides); one naming the table
        itself, no wildcard, is refused."""
        for pattern, codec in self.rules:
            if not codec.for_tables and pattern == name:
                takes = ", ".join(kind for kind, each in registered().items() if each.for_tables)
                raise InvalidArgumentError(
                    f"compression rule {pattern}={codec}: {codec.kind} compresses dense gradients "
                    f"only; table {name!r} takes one of {takes}"
                )
            if codec.for_tables and fnmatch.fnmatchcase(name, pattern):
                return codec
        return NONE

    def __bool__(self) -> bool:
        return any(codec != NONE for _, codec in self.rules)
