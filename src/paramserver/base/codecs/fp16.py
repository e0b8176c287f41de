"""`fp16`: the gradient cast to float16, its own shape (above 65504 is inf); no error feedback."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from paramserver.base.codecs._codec import Codec, Encoded
from paramserver.base.half import float16_to_float32, float32_to_float16


@dataclass(frozen=True)
class Float16(Codec):
    """Header {"codec": "fp16"}; main tensor float16, the gradient's shape."""

    kind: ClassVar[str] = "fp16"
    payload_dtype: ClassVar[np.dtype] = np.dtype(np.float16)

    def encode(self, grad: np.ndarray, chunk: int | None = None) -> Encoded:
        return Encoded({"codec": self.kind}, float32_to_float16(grad))

    @classmethod
    def decode(cls, name: str, header: dict, payload: np.ndarray, aux: dict[str, np.ndarray]) -> np.ndarray:
        return float16_to_float32(payload)
