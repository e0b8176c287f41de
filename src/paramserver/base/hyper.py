"""An optimizer's arguments from the wire, type-checked against its defaults before any is used.

A peer's {"name": ..., "hyper": {...}} is data: `hyper` must be an object, and each known argument
must have its default's kind (a number for a number, true/false (or 0/1) for a flag, a pair of
numbers for a pair).
Ranges are the optimizer's own checks (optimizers.py, sparse_optimizers.py).
"""

from __future__ import annotations

from typing import Any

from paramserver.base.errors import InvalidArgumentError


def hyper_arguments(owner: str, spec: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The arguments in `spec["hyper"]` (a copy), each of its default's kind; InvalidArgumentError
    naming the optimizer and the argument otherwise. Unknown names are left to the caller."""
    hyper = spec.get("hyper", {})
    if not isinstance(hyper, dict):
        raise InvalidArgumentError(f"{owner}: hyper must be an object of arguments, got {type(hyper).__name__}")
    for key, value in hyper.items():
        want = _kind(defaults.get(key))
        if want is not None and not _is(value, want):
            raise InvalidArgumentError(f"{owner}: argument {key!r} must be {want}, got {str(value)[:40]!r}")
    return dict(hyper)


def _kind(default: Any) -> str | None:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, (int, float)):
        return "a number"
    if isinstance(default, tuple):
        return "a pair of numbers"
    return None  # no default to compare with (e.g. torch's implementation switches)


def _is(value: Any, want: str) -> bool:
    if want == "true or false":
        return isinstance(value, (bool, int))  # torch.optim takes 0 and 1 for a flag too
    if want == "a number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, (list, tuple)) and all(_is(item, "a number") for item in value)
