"""Share of a table's rows a workload touches in k steps: analytic, and simulated to check it.

Each step draws `draws` ids independently from a distribution over `rows` rows; a row is touched
in k steps with probability 1 - (1 - p_j)^(k * draws), so the expected touched share is
1 - (1/rows) * sum_j (1 - p_j)^(k * draws). Distributions:

- `uniform`: p_j = 1 / rows;
- `zipf`: numpy's Zipf(a) folded onto the rows as the benchmarks draw it, ``(rng.zipf(a) - 1) %
  rows``: p_j = sum_{m >= 0} (j + 1 + m * rows)^-a / Z over the values numpy draws (up to 2^63 - 1;
  Z their sum); the draws past `rows`, 11% of them at 675M rows and a = 1.1, land spread over the
  whole table;
- `zipf_truncated`: the Zipf law cut at `rows`: p_j = (j + 1)^-a / H(rows, a).

The sum runs exactly over the first 2^16 rows and, past them, on a geometric grid of blocks (p
changes by under 0.2% across a block), so 675M rows take milliseconds. `simulate` draws the ids
(at a scaled size) to check the sums.
"""

from __future__ import annotations

import numpy as np

_EXACT = 1 << 16  # rows summed one by one; the rest in blocks
_BLOCK = 1.0 / 1024  # a block's width relative to its position
_INT64_MAX = 2**63 - 1  # numpy's zipf draws no larger value


def _zeta_tail(a: float, q: np.ndarray, terms: int = 16) -> np.ndarray:
    """Hurwitz zeta sum_{n >= 0} (q + n)^-a, by Euler-Maclaurin after `terms` terms."""
    total = sum((q + n) ** -a for n in range(terms))
    end = q + terms
    return total + end ** (1 - a) / (a - 1) + end**-a / 2 + a * end ** (-a - 1) / 12


def _grid(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(row index of each point, rows it stands for): every row up to _EXACT, then blocks."""
    exact = np.arange(min(rows, _EXACT), dtype=np.float64)
    if rows <= _EXACT:
        return exact, np.ones_like(exact)
    edges = [float(_EXACT)]
    while edges[-1] < rows:
        edges.append(min(float(rows), np.floor(edges[-1] * (1 + _BLOCK)) + 1))
    bounds = np.array(edges)
    mids = (bounds[:-1] + bounds[1:] - 1) / 2
    return np.concatenate([exact, mids]), np.concatenate([np.ones_like(exact), np.diff(bounds)])


def probabilities(kind: str, rows: int, a: float = 1.1) -> tuple[np.ndarray, np.ndarray]:
    """(p of each grid point's row, rows each point stands for)."""
    where, weight = _grid(rows)
    if kind == "uniform":
        return np.full_like(where, 1.0 / rows), weight
    if kind == "zipf_truncated":
        head = (where + 1) ** -a
        return head / float(np.dot(head, weight)), weight
    if kind == "zipf":  # numpy's zipf: P(k) ~ k^-a for 1 <= k <= 2^63 - 1 (it redraws past), folded by `% rows`
        top = float(_INT64_MAX)
        norm = float((_zeta_tail(a, np.array([1.0])) - _zeta_tail(a, np.array([top + 1])))[0])
        q = (where + 1) / rows
        laps = np.floor((top - where - 1) / rows)  # the last m with j + 1 + m * rows <= 2^63 - 1
        folded = (where + 1) ** -a + rows**-a * (_zeta_tail(a, 1 + q) - _zeta_tail(a, laps + 1 + q))
        return folded / norm, weight
    raise ValueError(f"unknown distribution {kind!r}")


def touched_share(kind: str, rows: int, draws: int, steps: list[int], a: float = 1.1) -> list[float]:
    """Expected share of the `rows` touched by `steps` steps of `draws` ids each, for each count."""
    p, weight = probabilities(kind, rows, a)
    log_miss = np.log1p(-np.minimum(p, 1 - 1e-16))
    return [1.0 - float(np.dot(np.exp(k * draws * log_miss), weight)) / rows for k in steps]


def simulate(kind: str, rows: int, draws: int, steps: list[int], seed: int, a: float = 1.1) -> list[float]:
    """Touched share after each of `steps` (increasing), by drawing the ids (numpy, seeded)."""
    rng = np.random.default_rng(seed)
    seen = np.zeros(rows, dtype=bool)
    found, done = [], 0
    chunk = max(1, (8 << 20) // draws)  # steps drawn at once (about 8M ids)
    for target in steps:
        while done < target:
            n = min(chunk, target - done) * draws
            if kind == "uniform":
                ids = rng.integers(0, rows, n)
            elif kind == "zipf":
                ids = (rng.zipf(a, n) - 1) % rows
            else:
                raise ValueError(f"simulate: no sampler for {kind!r}")
            seen[ids] = True
            done += n // draws
        found.append(float(np.count_nonzero(seen)) / rows)
    return found
