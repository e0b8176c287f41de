"""Sizes in bytes as people write them: ``4GiB``, ``512MiB``, ``1.5GB``, ``16Gi``, ``1000000``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    **{f"{p}i{b}": 1 << (10 * (i + 1)) for i, p in enumerate("kmgt") for b in ("", "b")},  # KiB, Ki, ...
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def parse_byte_size(text: str) -> int:
    """Bytes of `text`: a number with an optional unit, B, KB/MB/GB/TB (powers of 1000) or
    KiB/MiB/GiB/TiB (powers of 1024, also written Ki/Mi/Gi/Ti), in any case. ValueError otherwise."""
    match = _SIZE.match(text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"{text!r} is not a size in bytes (e.g. 4GiB, 512MiB, 1000000)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit]) if "." in number else int(number) * _UNITS[unit]
