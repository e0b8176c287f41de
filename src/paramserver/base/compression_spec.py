"""Which gradients are compressed, and how: the `compression` option, parsed.

The option is one comma-separated list of `PATTERN=CODEC` rules, or a bare `CODEC` for every
gradient; the first rule whose pattern (fnmatch, e.g. `mlp.*`) matches a parameter's name
(`model.named_parameters()`) or a table's name wins, and a name no rule matches is sent as is.

Codecs: `none`, `fp16`, `bf16` (a cast), `int8` (quantized, with error feedback),
`topk:R` (the largest fraction R of the values, with error feedback; dense variables only: a table
skips topk rules, see `codec_for_table`).

    "fp16"                                   every gradient as float16
    "mlp.*=int8,ctr.embedding=bf16"          two rules; the rest as is
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from paramserver.base.errors import InvalidArgumentError

CODECS = ("none", "fp16", "bf16", "int8", "topk")


@dataclass(frozen=True)
class Codec:
    """One compression codec: `kind` in CODECS; `ratio` the kept fraction for topk."""

    kind: str
    ratio: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Codec:
        kind, _, arg = text.strip().partition(":")
        if kind not in CODECS:
            raise InvalidArgumentError(
                f"unknown compression codec {text.strip()!r} (one of none, fp16, bf16, int8, topk:R)"
            )
        if kind != "topk":
            if arg:
                raise InvalidArgumentError(f"compression codec {kind!r} takes no argument, got {text.strip()!r}")
            return cls(kind)
        try:
            ratio = float(arg)
        except ValueError:
            raise InvalidArgumentError(
                f"compression codec topk needs a ratio, e.g. topk:0.01, got {text.strip()!r}"
            ) from None
        if not 0.0 < ratio <= 1.0:
            raise InvalidArgumentError(f"topk ratio must be in (0, 1], got {ratio}")
        return cls(kind, ratio)

    def __str__(self) -> str:
        return f"topk:{self.ratio:g}" if self.kind == "topk" else self.kind


NONE = Codec("none")


@dataclass(frozen=True)
class CompressionSpec:
    """The parsed `compression` option: ordered (pattern, codec) rules."""

    rules: tuple[tuple[str, Codec], ...] = ()

    @classmethod
    def parse(cls, text: str) -> CompressionSpec:
        rules = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            pattern, sep, codec = part.rpartition("=")
            if sep and not pattern.strip():
                raise InvalidArgumentError(f"compression rule {part!r} has an empty pattern")
            rules.append((pattern.strip() if sep else "*", Codec.parse(codec)))
        return cls(tuple(rules))

    def codec_for(self, name: str) -> Codec:
        """The codec of the parameter or table called `name` (NONE when no rule matches)."""
        for pattern, codec in self.rules:
            if fnmatch.fnmatchcase(name, pattern):
                return codec
        return NONE

    def codec_for_table(self, name: str) -> Codec:
        """The codec of table `name`'s row gradients. topk rules are for dense variables: a table skips
        them (the next matching rule decides); one naming the table itself, no wildcard, is refused."""
        for pattern, codec in self.rules:
            if codec.kind == "topk" and pattern == name:
                raise InvalidArgumentError(
                    f"compression rule {pattern}={codec}: topk compresses dense gradients "
                    f"only; table {name!r} takes fp16, bf16 or int8"
                )
            if codec.kind != "topk" and fnmatch.fnmatchcase(name, pattern):
                return codec
        return NONE

    def __bool__(self) -> bool:
        return any(codec.kind != "none" for _, codec in self.rules)
