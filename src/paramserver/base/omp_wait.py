"""OpenMP's passive wait, set before torch loads (paramserver/__init__.py imports this first).

torch's intra-op threads are OpenMP threads (libgomp in the CPU wheels; MKL runs on the same
runtime). By default idle ones spin for a while before they sleep, and a worker leaves its
parallel regions between every two steps to wait for its PS: the spinning threads then take the
cores the PS and every other process need (docs/performance.md, "Torch threads of a worker").
libgomp reads its wait policy once, when it is loaded with torch: a variable set later does
nothing in this process. So importing paramserver sets the variables unless the environment
already sets one of them (a value the user set wins); a script that imports paramserver before
torch gets the passive wait, and so does every process it starts (`paramserver run`'s and
`paramserver node`'s children, a DataLoader's spawned workers).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

# Each variable is a runtime's own knob for the same thing: libgomp reads OMP_WAIT_POLICY (and
# GOMP_SPINCOUNT), Intel's OpenMP KMP_BLOCKTIME (milliseconds a thread spins before it sleeps).
PASSIVE_WAIT_ENV: Mapping[str, str] = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}


def wait_policy_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that make OpenMP threads sleep when idle, to add to `environ`; none when it
    already sets one of them (the user's choice stands)."""
    if any(name in environ for name in PASSIVE_WAIT_ENV):
        return {}
    return dict(PASSIVE_WAIT_ENV)


_added = wait_policy_env(os.environ)
# torch (and its libgomp) was loaded before paramserver with no wait policy chosen: this process's
# OpenMP threads spin when idle whatever is set now (its children still get the passive wait)
spinning_since_torch_loaded_first = bool(_added) and "torch" in sys.modules
os.environ.update(_added)
