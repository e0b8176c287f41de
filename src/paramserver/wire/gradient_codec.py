"""Compressed gradients in a request: each one decoded to float32 by the codec its header names.

The worker encodes (client/compression.py), the PS decodes (server/shard_service.py) before any
check or state change; both use the codecs of base/codecs/ (one module each, which gives its format).
A compressed gradient travels as its main tensor under the gradient's own name, plus auxiliary
tensors named `aux_name(name, key)`, and a header in the request's `codecs` (by gradient name):
{"codec": KIND, ...}, KIND a registered codec's kind, the rest of the header that codec's.

A bad encoding (unknown codec, wrong dtype, an auxiliary tensor missing or wrong, an index out of
range) raises InvalidArgumentError naming the gradient. Thread-safe.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from paramserver.base.codecs import Codec, aux_name, registered
from paramserver.base.errors import InvalidArgumentError

__all__ = ["aux_name", "decode", "decode_tensors"]


def _codec_of(header: Any) -> type[Codec] | None:
    """The registered codec `header` names (None when it names none)."""
    kind = header.get("codec") if isinstance(header, dict) else None
    return registered().get(kind) if isinstance(kind, str) else None


def decode(name: str, header: Any, payload: np.ndarray, aux: dict[str, np.ndarray]) -> np.ndarray:
    """Gradient `name` as float32, from its header, main tensor and auxiliary tensors."""
    codec = _codec_of(header)
    if codec is None:
        raise InvalidArgumentError(
            f"gradient {name!r}: unknown encoding {str(header)[:100]} (codec one of {', '.join(registered())})"
        )
    if payload.dtype != codec.payload_dtype:
        raise InvalidArgumentError(
            f"gradient {name!r}: {codec.kind} carries {codec.payload_dtype.name}, got {payload.dtype}"
        )
    return codec.decode(name, header, payload, aux)


def decode_tensors(tensors: dict[str, np.ndarray], codecs: dict[str, Any]) -> dict[str, np.ndarray]:
    """A request's tensors with every gradient named in `codecs` decoded to float32 and its auxiliary
    tensors removed (a new dict: nothing else changes). Raises InvalidArgumentError."""
    if not codecs:
        return tensors
    out = dict(tensors)
    for name, header in codecs.items():
        if name not in tensors:
            raise InvalidArgumentError(f"encoding given for gradient {name!r}, which the request does not carry")
        codec = _codec_of(header)
        kind, keys = (codec.kind, codec.aux) if codec is not None else ("", ())  # unknown: decode() refuses it
        aux = {}
        for key in keys:
            if aux_name(name, key) not in out:
                raise InvalidArgumentError(f"gradient {name!r}: {kind} needs tensor {aux_name(name, key)!r}")
            aux[key] = out.pop(aux_name(name, key))
        out[name] = decode(name, header, tensors[name], aux)
    return out
