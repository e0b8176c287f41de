"""Mixed precision on the wire: the seed MLP's push + pull as float32, bfloat16 and float16.

One real PS process (127.0.0.1) and this process as the worker. For each transport and dtype, the
seed MLP (784-1024-512-10, 1.33 M parameters, Adam) pushes fixed gradients and pulls its values
(`opt.step()` with no forward or backward, so that only the wire and the PS count), back to back in
one run. Prints one JSON line: bytes per step (request + reply) and ms per step by dtype, and each
half dtype's ratios to float32.

    python bench/mixed_precision.py [--steps 100] [--transports shm,tcp]
"""

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn as nn

import paramserver as ps
from paramserver.base.config import ClusterSpec, NodeConfig, Options, Task
from paramserver.nn.wire_dtype import wire_array
from paramserver.wire import codec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TRANSPORTS = {"shm": dict(use_stream=True, shared_memory=True), "tcp": dict(use_stream=True, shared_memory=False)}


def start_ps() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "paramserver", "--log-level", "WARNING", "node", "--role", "ps",
                             "--index", "0", "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("PARAMSERVER_READY"):
        proc.kill()
        raise SystemExit(f"PS did not start: {line!r}")
    return proc, line.split()[-1]


def measure(opt, steps: int) -> float:
    """ms per push + pull, after a few warm-up steps."""
    for _ in range(5):
        opt.step()
    started = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - started) * 1000 / steps


def step_bytes(opt) -> int:
    """Bytes of one step's request and reply."""
    grads = [(var, wire_array(param.grad)) for var, param in opt._vars]
    _, values = opt.context.client.push_pull(dict(grads), [var for var, _ in grads]).wait(60)
    pulled = [(part.name, array) for part, array in values]
    return codec.parts_size(codec.encode_parts({}, grads)) + codec.parts_size(codec.encode_parts({}, pulled))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--transports", default="shm,tcp")
    args = parser.parse_args()
    torch.set_num_threads(1)
    proc, address = start_ps()
    result: dict = {"bench": "mixed_precision", "steps": args.steps}
    try:
        for transport in args.transports.split(","):
            config = NodeConfig(ClusterSpec(ps=(address,), worker=("127.0.0.1:0",)), Task("worker", 0),
                                Options(connect_timeout_s=20, **TRANSPORTS[transport]))
            ctx = ps.init(config)
            for name, dtype in DTYPES.items():
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                                      nn.Linear(512, 10)).to(dtype)
                opt = ps.optim.Adam(model.parameters(), lr=1e-6)
                for param in model.parameters():
                    param.grad = torch.full_like(param, 1e-3)
                result[f"{transport}_{name}_ms"] = round(measure(opt, args.steps), 2)
                if transport == "shm":
                    result[f"{name}_bytes_per_step"] = step_bytes(opt)
            ctx.shutdown()
        for name in ("bfloat16", "float16"):
            ratio = result[f"{name}_bytes_per_step"] / result["float32_bytes_per_step"]
            result[f"{name}_bytes_ratio"] = round(ratio, 3)
            for transport in args.transports.split(","):
                result[f"{transport}_{name}_time_ratio"] = round(
                    result[f"{transport}_{name}_ms"] / result[f"{transport}_float32_ms"], 2)
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
