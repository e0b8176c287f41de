"""The worker's side of gradient compression: each variable's codec, and the error feedback.

int8 and topk lose part of every gradient; the worker keeps what was lost (the residual, one
array per variable) and adds it to that variable's next gradient before encoding (error feedback,
as in 1-bit SGD and EF-SGD): over many steps the decoded gradients sum to the true ones, give or
take one residual. fp16 and bf16 are plain casts, without feedback. Row gradients of a table
are encoded without feedback (a residual per id would grow with the ids a worker ever saw);
their int8 scales are one per row. Format: wire/gradient_codec.py. Not thread-safe.
"""

from __future__ import annotations

import numpy as np

from paramserver.base.compression_spec import NONE, Codec
from paramserver.wire import gradient_codec

FEEDBACK = ("int8", "topk")  # the codecs that lose enough to need a residual


class GradientCompressor:
    """Encodes a worker's gradients by variable; counts the gradient bytes it produced."""

    def __init__(self) -> None:
        self.codecs: dict[str, Codec] = {}  # by variable; absent: sent as is
        self.residuals: dict[str, np.ndarray] = {}  # by variable, of its whole shape (all its parts)
        self.gradient_bytes = 0  # of every gradient pushed, as encoded (scales and positions included)

    def add(self, var: str, codec: Codec, shape: tuple[int, ...]) -> None:
        """Encode variable `var` (of `shape`) by `codec` from now on."""
        if codec.kind != "none":
            self.codecs[var] = codec
        if codec.kind in FEEDBACK:
            self.residuals[var] = np.zeros(shape, np.float32)

    def encode(
        self, var: str, name: str, grad: np.ndarray, rows: slice | None = None
    ) -> tuple[dict | None, list[tuple[str, np.ndarray]]]:
        """(header or None, tensors) of `grad`, variable `var`'s gradient (or its `rows`), sent as `name`.
        `grad` itself is never changed."""
        codec = self.codecs.get(var, NONE)
        if codec.kind == "none":
            self.gradient_bytes += grad.nbytes
            return None, [(name, grad)]
        if codec.kind not in FEEDBACK:
            encoded = gradient_codec.encode(codec, grad)
        else:
            residual = self.residuals[var] if rows is None else self.residuals[var][rows]
            corrected = grad + residual
            encoded = gradient_codec.encode(codec, corrected)
            np.subtract(
                corrected, gradient_codec.decode(name, encoded.header, encoded.payload, encoded.aux), out=residual
            )
        self.gradient_bytes += encoded.nbytes
        return encoded.header, encoded.tensors(name)

    def encode_rows(self, codec: Codec, name: str, grads: np.ndarray) -> tuple[dict | None, list]:
        """(header or None, tensors) of a table's row gradients (rows x dim), one int8 scale per row."""
        if codec.kind == "none":
            self.gradient_bytes += grads.nbytes
            return None, [(name, grads)]
        encoded = gradient_codec.encode(codec, grads, chunk=max(1, grads.shape[-1]))
        self.gradient_bytes += encoded.nbytes
        return encoded.header, encoded.tensors(name)
