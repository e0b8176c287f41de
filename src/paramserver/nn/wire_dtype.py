"""Torch tensors in their wire dtype (wire/half.py): float32, float16 as is, bfloat16 as uint16 bits.

A bfloat16 or float16 parameter pushes its gradients and receives its values in its own dtype; the
PS keeps float32 masters. Thread-safe (no state).
"""

from __future__ import annotations

import numpy as np
import torch

from paramserver.base.errors import FailedPreconditionError
from paramserver.wire.half import WIRE_DTYPES, bf16_bits_to_float32, float16_to_float32

WIRE_OF = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# how a float32 variable's values pulled at half width (PushPull's pull_as) widen again, by their dtype
PULLED_AS = {np.dtype(np.uint16): bf16_bits_to_float32, np.dtype(np.float16): float16_to_float32}


def wire_array(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's values as they travel: a view of a CPU tensor, bfloat16 as its uint16 bits."""
    if tensor.dtype is not torch.bfloat16 and tensor.is_cpu and not tensor.requires_grad:
        return tensor.numpy()  # a gradient on the CPU: viewed as it is, no tensor made
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def write_wire(name: str, target: torch.Tensor, array: np.ndarray) -> None:
    """Copy values that travelled in `target`'s wire dtype into `target` (on its own device)."""
    if target.dtype is torch.float32 and array.dtype == np.float32 and target.is_cpu:
        np.copyto(target.numpy(), array)  # the common case, checked in one go
        return
    if target.dtype is torch.float32 and array.dtype in PULLED_AS:  # a float32 variable pulled at half width
        widen = PULLED_AS[array.dtype]
        if target.is_cpu and target.is_contiguous():
            widen(array, target.numpy())
        else:
            target.copy_(torch.from_numpy(widen(array)), non_blocking=False)
        return
    wire = WIRE_OF[target.dtype]
    if array.dtype != WIRE_DTYPES[wire]:
        raise FailedPreconditionError(
            f"values of {name!r} came back as {array.dtype}, not as {wire} travels "
            f"({WIRE_DTYPES[wire]}): a PS of a version without mixed precision?"
        )
    if target.dtype == torch.bfloat16:
        target, array = target.view(torch.int16), array.view(np.int16)
    if target.device.type == "cpu":
        np.copyto(target.numpy(), array)
    else:
        target.copy_(torch.from_numpy(np.array(array)), non_blocking=False)
