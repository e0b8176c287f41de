"""What a gradient codec is: the Codec base class, an encoded gradient, and NONE (no codec at all)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from paramserver.base.errors import InvalidArgumentError


def aux_name(name: str, key: str) -> str:
    """The name of gradient `name`'s auxiliary tensor `key` (a leading "~": never a variable's name)."""
    return f"~{name}.{key}"


@dataclass(frozen=True)
class Encoded:
    """One encoded gradient: the request's header for it, its main tensor and its auxiliary ones."""

    header: dict[str, Any]
    payload: np.ndarray
    aux: dict[str, np.ndarray] = field(default_factory=dict)

    def tensors(self, name: str) -> list[tuple[str, np.ndarray]]:
        return [(name, self.payload), *((aux_name(name, key), array) for key, array in self.aux.items())]

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes + sum(array.nbytes for array in self.aux.values())


@dataclass(frozen=True)
class Codec(ABC):
    """One gradient codec as the `compression` option chose it: an instance carries the codec's
    argument (topk's ratio), the class everything else. Immutable, thread-safe.

    A subclass in a module of its own in paramserver.base.codecs is a codec (the registry finds it).
    The worker encodes a float32 gradient (client/compression.py), the PS decodes it from the request's
    header {"codec": kind, ...}, main tensor (of `payload_dtype`, under the gradient's name) and the
    auxiliary tensors named `aux_name(gradient, key)` for each key of `aux` (wire/gradient_codec.py).
    """

    kind: ClassVar[str]  # its name in the `compression` option and in the header's "codec"
    payload_dtype: ClassVar[np.dtype]  # the dtype of its main tensor
    aux: ClassVar[tuple[str, ...]] = ()  # the keys of its auxiliary tensors
    # lossy enough that the worker keeps what encoding lost (a residual per variable, see `residual`)
    # and adds it to the variable's next gradient; never for a table's rows (a residual per id)
    error_feedback: ClassVar[bool] = False
    for_tables: ClassVar[bool] = True  # may encode a table's row gradients
    argument: ClassVar[str] = ""  # how its argument is written in the option's help ("R": topk:R); "": none

    @classmethod
    def from_argument(cls, argument: str, text: str) -> Codec:
        """This codec written `text` in the option, `argument` the part after its colon ("" if none).
        Raises InvalidArgumentError. Codecs that take an argument override this."""
        if argument:
            raise InvalidArgumentError(f"compression codec {cls.kind!r} takes no argument, got {text!r}")
        return cls()

    @abstractmethod
    def encode(self, grad: np.ndarray, chunk: int | None = None) -> Encoded:
        """`grad` (float32) encoded; `grad` itself is never changed. `chunk`: values per block for a codec
        that scales by blocks (None: its own default; a table's rows pass their width, one block a row)."""

    @classmethod
    @abstractmethod
    def decode(cls, name: str, header: dict, payload: np.ndarray, aux: dict[str, np.ndarray]) -> np.ndarray:
        """Gradient `name` as float32, from its header, main tensor (already checked to be of
        `payload_dtype`) and auxiliary tensors (one for each key of `aux`). Raises InvalidArgumentError
        naming the gradient when they do not fit together."""

    def residual(self, name: str, corrected: np.ndarray, encoded: Encoded, out: np.ndarray) -> None:
        """Error feedback: write into `out` what encoding `corrected` (a gradient plus the previous
        residual) into `encoded` lost, to be added to the next gradient."""
        np.subtract(corrected, self.decode(name, encoded.header, encoded.payload, encoded.aux), out=out)

    def __str__(self) -> str:
        return self.kind


@dataclass(frozen=True)
class Uncompressed(Codec):
    """`none`: the gradient travels as it is, float32 with no header. Not a codec of the registry:
    what a rule choosing no codec, or no rule, gives."""

    kind: ClassVar[str] = "none"
    payload_dtype: ClassVar[np.dtype] = np.dtype(np.float32)

    def encode(self, grad: np.ndarray, chunk: int | None = None) -> Encoded:
        raise InvalidArgumentError("codec none does not encode gradients")

    @classmethod
    def decode(cls, name: str, header: dict, payload: np.ndarray, aux: dict[str, np.ndarray]) -> np.ndarray:
        raise InvalidArgumentError(f"gradient {name!r}: codec none does not decode gradients")


NONE = Uncompressed()
