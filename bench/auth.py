"""What tokens cost a call: one real PS process, a worker's pushes and pulls over the tensor stream
(TCP) with and without a token store, alternated run by run. One JSON line: mean microseconds per
PushPull of the seed MLP's gradients (about 5 MB) and of a small 1 KB frame, each way, and the ratios.

    python bench/auth.py [--calls 200] [--rounds 3]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from paramserver.security.tokens import write_tokens  # noqa: E402
from paramserver.transport.grpc_transport import GrpcChannel  # noqa: E402
from paramserver.wire import codec  # noqa: E402

SEED_MLP = {"w1": (1024, 784), "b1": (1024,), "w2": (512, 1024), "b2": (512,), "w3": (10, 512), "b3": (10,)}
SMALL = {"b": (256,)}


def start_ps(options: dict) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PARAMSERVER_OPTIONS=json.dumps(options), PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen([sys.executable, "-m", "paramserver", "--log-level", "WARNING", "node", "--role", "ps",
                             "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True, env=env)
    return proc, proc.stdout.readline().split()[-1]


def per_call_us(address: str, token: str | None, shapes: dict, calls: int) -> float:
    channel = GrpcChannel(address, 1 << 30, use_stream=True, use_shared_memory=False, token=token)
    try:
        channel.wait_ready(30)
        values = [(name, np.zeros(shape, np.float32)) for name, shape in shapes.items()]
        group = f"g{len(shapes)}"
        meta = {"group": group, "optimizer": {"name": "sgd", "hyper": {"lr": 0.0}}, "worker": 0}
        channel.call("Register", codec.encode(meta, values), 30).wait(30)
        push = codec.encode({"worker": 0}, values)
        for _ in range(5):
            channel.call("PushPull", push, 30).wait(30)
        started = time.perf_counter()
        for _ in range(calls):
            channel.call("PushPull", push, 30).wait(30)
        return (time.perf_counter() - started) / calls * 1e6
    finally:
        channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_tokens(Path(tmp), ["ps-0", "worker-0"])
        token = (Path(tmp) / "worker-0.token").read_text().strip()
        for _ in range(args.rounds):
            for way, options, presented in (("plain", {}, None),
                                            ("tokens", {"auth_tokens": str(Path(tmp) / "tokens.json")}, token)):
                proc, address = start_ps(options)
                try:
                    for size, shapes in (("mlp", SEED_MLP), ("small", SMALL)):
                        key = f"{size}_{way}_us"
                        results.setdefault(key, []).append(per_call_us(address, presented, shapes, args.calls))
                finally:
                    proc.terminate()
                    proc.wait(30)
    line = {key: round(float(np.median(values)), 1) for key, values in results.items()}
    for size in ("mlp", "small"):
        line[f"{size}_ratio"] = round(line[f"{size}_tokens_us"] / line[f"{size}_plain_us"], 3)
    line.update(calls=args.calls, rounds=args.rounds, transport="tcp stream")
    print(json.dumps(line))


if __name__ == "__main__":
    main()
