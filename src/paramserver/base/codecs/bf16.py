"""`bf16`: the gradient cast to bfloat16 (the upper 16 bits of float32, rounded to nearest even, as
uint16; base/half.py), its own shape; no error feedback."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from paramserver.base.codecs._codec import Codec, Encoded
from paramserver.base.half import bf16_bits_to_float32, float32_to_bf16_bits


@dataclass(frozen=True)
class BFloat16(Codec):
    """Header {"codec": "bf16"}; main tensor uint16 (bfloat16 bits), the gradient's shape."""

    kind: ClassVar[str] = "bf16"
    payload_dtype: ClassVar[np.dtype] = np.dtype(np.uint16)

    def encode(self, grad: np.ndarray, chunk: int | None = None) -> Encoded:
        return Encoded({"codec": self.kind}, float32_to_bf16_bits(np.ascontiguousarray(grad, dtype=np.float32)))

    @classmethod
    def decode(cls, name: str, header: dict, payload: np.ndarray, aux: dict[str, np.ndarray]) -> np.ndarray:
        return bf16_bits_to_float32(payload)
