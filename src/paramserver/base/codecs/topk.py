"""`topk:R`: only the largest fraction R of the gradient's values (by magnitude) and their positions,
with error feedback. Dense gradients only: a table's row gradients take another codec (a rule with
topk is skipped for tables, see CompressionSpec.codec_for_table)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from paramserver.base.codecs._codec import Codec, Encoded
from paramserver.base.errors import InvalidArgumentError


@dataclass(frozen=True)
class TopK(Codec):
    """Header {"codec": "topk", "shape": [..]}; main tensor float32, the kept values; auxiliary tensor
    `index`: their strictly increasing positions (int32 or int64) in the flattened gradient. The
    rest are zero. `ratio`: the kept fraction, in (0, 1] (at least one value is kept)."""

    kind: ClassVar[str] = "topk"
    payload_dtype: ClassVar[np.dtype] = np.dtype(np.float32)
    aux: ClassVar[tuple[str, ...]] = ("index",)
    error_feedback: ClassVar[bool] = True
    for_tables: ClassVar[bool] = False
    argument: ClassVar[str] = "R"

    ratio: float

    @classmethod
    def from_argument(cls, argument: str, text: str) -> TopK:
        try:
            ratio = float(argument)
        except ValueError:
            raise InvalidArgumentError(f"compression codec topk needs a ratio, e.g. topk:0.01, got {text!r}") from None
        if not 0.0 < ratio <= 1.0:
            raise InvalidArgumentError(f"topk ratio must be in (0, 1], got {ratio}")
        return cls(ratio)

    def encode(self, grad: np.ndarray, chunk: int | None = None) -> Encoded:
        flat = grad.reshape(-1)
        keep = min(flat.size, max(1, math.ceil(self.ratio * flat.size)))
        index = (
            np.sort(np.argpartition(np.abs(flat), flat.size - keep)[flat.size - keep :])
            if keep < flat.size
            else np.arange(flat.size)
        )
        index = index.astype(np.int32 if flat.size <= np.iinfo(np.int32).max else np.int64)
        return Encoded(
            {"codec": self.kind, "shape": list(grad.shape)}, flat[index].astype(np.float32), {"index": index}
        )

    @classmethod
    def decode(cls, name: str, header: dict, payload: np.ndarray, aux: dict[str, np.ndarray]) -> np.ndarray:
        shape, index = header.get("shape"), aux["index"]
        if (
            not isinstance(shape, list)
            or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)
            or len(shape) > 32
        ):
            raise InvalidArgumentError(f"gradient {name!r}: topk shape must be a list of sizes, got {str(shape)[:100]}")
        size = math.prod(shape)
        if index.dtype not in (np.int32, np.int64) or index.ndim != 1 or payload.shape != index.shape:
            raise InvalidArgumentError(
                f"gradient {name!r}: topk needs 1-d int32/int64 positions, one per value; got "
                f"{index.dtype} {tuple(index.shape)} for values {tuple(payload.shape)}"
            )
        if index.size and (index[0] < 0 or index[-1] >= size or not (index[1:] > index[:-1]).all()):
            raise InvalidArgumentError(
                f"gradient {name!r}: topk positions must be strictly increasing within [0, {size})"
            )
        dense = np.zeros(size, np.float32)
        dense[index] = payload
        return dense.reshape(shape)

    def __str__(self) -> str:
        return f"topk:{self.ratio:g}"
