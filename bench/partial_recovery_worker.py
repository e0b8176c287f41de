"""examples/ctr.py with a timestamped line after every optimizer step ("STEP <n> <unix time>"), for
bench/partial_recovery.py to time a recovery to the next step trained. Arguments: ctr.py's."""

import runpy
import sys
import time
from pathlib import Path

from paramserver.optim.ps_optimizers import PSOptimizer

CTR = str(Path(__file__).resolve().parents[1] / "examples" / "ctr.py")
_step = PSOptimizer.step


def _timed_step(self, closure=None):
    loss = _step(self, closure)
    print(f"STEP {self.steps} {time.time():.3f}", flush=True)
    return loss


PSOptimizer.step = _timed_step  # type: ignore[method-assign]
sys.argv = [CTR, *sys.argv[1:]]
runpy.run_path(CTR, run_name="__main__")
