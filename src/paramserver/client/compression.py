"""The worker's side of gradient compression: each variable's codec, and the error feedback.

A codec that loses part of every gradient (its `error_feedback`: int8, topk) has the worker keep
what was lost (the residual, one array per variable) and add it to that variable's next gradient
before encoding (error feedback, as in 1-bit SGD and EF-SGD): over many steps the decoded gradients
sum to the true ones, give or take one residual. The codec says what was lost (Codec.residual).
Casts (fp16, bf16) keep none. Row gradients of a table are encoded without feedback (a residual per
id would grow with the ids a worker ever saw); their int8 scales are one per row. Codecs and their
formats: base/codecs/. Not thread-safe.
"""

from __future__ import annotations

import numpy as np

from paramserver.base.codecs import NONE, Codec


class GradientCompressor:
    """Encodes a worker's gradients by variable; counts the gradient bytes it produced."""

    def __init__(self) -> None:
        self.codecs: dict[str, Codec] = {}  # by variable; absent: sent as is
        self.residuals: dict[str, np.ndarray] = {}  # by variable, of its whole shape (all its parts)
        self.gradient_bytes = 0  # of every gradient pushed, as encoded (scales and positions included)

    def add(self, var: str, codec: Codec, shape: tuple[int, ...]) -> None:
        """Encode variable `var` (of `shape`) by `codec` from now on (NONE: send it as it is again)."""
        if codec != NONE:
            self.codecs[var] = codec
        else:
            self.codecs.pop(var, None)
        self.residuals.pop(var, None)  # a residual belongs to the codec that made it
        if codec.error_feedback:
            self.residuals[var] = np.zeros(shape, np.float32)

    def encode(
        self, var: str, name: str, grad: np.ndarray, rows: slice | None = None
    ) -> tuple[dict | None, list[tuple[str, np.ndarray]]]:
        """(header or None, tensors) of `grad`, variable `var`'s gradient (or its `rows`), sent as `name`.
        `grad` itself is never changed."""
        codec = self.codecs.get(var, NONE)
        if codec == NONE:
            self.gradient_bytes += grad.nbytes
            return None, [(name, grad)]
        if not codec.error_feedback:
            encoded = codec.encode(grad)
        else:
            residual = self.residuals[var] if rows is None else self.residuals[var][rows]
            corrected = grad + residual
            encoded = codec.encode(corrected)
            codec.residual(name, corrected, encoded, out=residual)
        self.gradient_bytes += encoded.nbytes
        return encoded.header, encoded.tensors(name)

    def encode_rows(self, codec: Codec, name: str, grads: np.ndarray) -> tuple[dict | None, list]:
        """(header or None, tensors) of a table's row gradients (rows x dim), one block (int8: one scale)
        per row; never error feedback."""
        if codec == NONE:
            self.gradient_bytes += grads.nbytes
            return None, [(name, grads)]
        encoded = codec.encode(grads, chunk=max(1, grads.shape[-1]))
        self.gradient_bytes += encoded.nbytes
        return encoded.header, encoded.tensors(name)
