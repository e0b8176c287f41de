"""Load: many concurrent clients push and pull one real PS process for a bounded time.

One PS process (`paramserver node --role ps`) holds a dense variable (`--dense-mb`) and an embedding
table (dim 16), both with SGD at lr 1 and zero initial values. `--clients` client processes
(processes, not threads: with threads the GIL would measure the clients, not the PS) each send
requests back to back for `--seconds`: one PushPull per request carrying a gradient of ones for the
dense variable, a row push of ones for `--ids` distinct random ids (of 100,000 rows made at setup),
a lookup of those ids, and the pull of the dense variable. Each client counts its requests, errors and latencies.

At the end every update must be there exactly once: the dense values equal minus the number of
dense pushes applied, and each row minus the number of pushes of its id (`lost_or_doubled` counts
the values that differ). The PS's resident memory (psutil, sampled every 0.5 s) is reported after
setup, after the warm-up, at the end of the load, at its peak, and once the clients are gone and the
PS closed their connections (its thread count back to where it started). Prints one JSON line:

    python bench/load.py [--seconds 60] [--clients 32] [--dense-mb 2] [--transport tcp|shm|grpc]
"""

import argparse
import json
import selectors
import subprocess
import sys
import threading
import time

import numpy as np
import psutil

from paramserver.client.ps_client import PSClient
from paramserver.client.table_client import TableClient
from paramserver.transport.grpc_transport import GrpcChannel

GROUP, VAR, TABLE, DIM, ID_SPACE = "load.group0", "load.dense", "load.table", 16, 100_000
SGD = {"name": "sgd", "hyper": {"lr": 1.0}}
RPC_TIMEOUT_S = 120.0  # a request's deadline: generous, the PS is loaded on purpose
START_TIMEOUT_S = 120.0  # for the PS and for every client to connect


def channel(address: str, transport: str) -> GrpcChannel:
    return GrpcChannel(address, 1 << 30, use_stream=transport != "grpc", use_shared_memory=transport == "shm")


def connect(address: str, transport: str, dense_values: int, worker: int) -> tuple[PSClient, TableClient]:
    """A client that registered the variable and the table (the first registration wins)."""
    client = PSClient([channel(address, transport)], RPC_TIMEOUT_S, worker=worker)
    client.connect(START_TIMEOUT_S)
    client.register(GROUP, SGD, {VAR: np.zeros(dense_values, np.float32)}).wait(RPC_TIMEOUT_S)
    tables = TableClient(client.channels, RPC_TIMEOUT_S)
    tables.register(TABLE, DIM, SGD, {"kind": "zeros"})
    return client, tables


def run_client(args: argparse.Namespace) -> None:
    """One client process: connect, say "ready", wait for "go" on stdin, send requests for `seconds`,
    print one JSON line with its counts."""
    client, tables = connect(args.address, args.transport, args.dense_values, args.worker)
    grads = np.ones(args.dense_values, np.float32)
    row_grads = np.ones((args.ids, DIM), np.float32)
    rng = np.random.default_rng(args.worker)
    pushes = np.zeros(ID_SPACE, np.int64)  # row pushes per id that the PS acknowledged
    latencies, errors, dense_pushes = [], {}, 0
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        ids = np.sort(rng.choice(ID_SPACE, args.ids, replace=False)).astype(np.int64)
        riders = tables.riders()
        riders.push(TABLE, ids, row_grads)
        riders.lookup(TABLE, ids)
        started = time.perf_counter()
        try:
            handle = client.push_pull({VAR: grads}, [VAR], riders=riders)
            handle.wait(RPC_TIMEOUT_S)
        except Exception as exc:  # counted: the verdict is the number of errors
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            continue
        latencies.append(time.perf_counter() - started)
        dense_pushes += 1
        pushes[ids] += 1
    client.close()
    touched = np.flatnonzero(pushes)
    print(json.dumps({"latencies": [round(s * 1000, 3) for s in latencies], "errors": errors,
                      "dense_pushes": dense_pushes, "ids": touched.tolist(),
                      "id_pushes": pushes[touched].tolist()}), flush=True)


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """proc's next stdout line, within `timeout` seconds ("" if it ended or took longer)."""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        return proc.stdout.readline() if selector.select(timeout) else ""


def rss_mb(process: psutil.Process) -> float:
    return round(process.memory_info().rss / 2**20, 1)


def start_clients(args: argparse.Namespace, address: str, dense_values: int) -> list[subprocess.Popen]:
    clients = []
    for worker in range(args.clients):
        argv = [sys.executable, __file__, "--client", "--address", address, "--worker", str(worker),
                "--transport", args.transport, "--dense-values", str(dense_values), "--ids", str(args.ids),
                "--seconds", str(args.seconds)]
        clients.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for proc in clients:
        if read_line(proc, START_TIMEOUT_S).strip() != "ready":
            raise SystemExit(f"a client did not connect within {START_TIMEOUT_S:.0f}s (exit code {proc.poll()})")
    return clients


def collect(clients: list[subprocess.Popen], ps: psutil.Process, seconds: float) -> tuple[list[dict], dict]:
    """Each client's result line, and the PS's RSS (MB) while they ran: peak, after the warm-up
    (the first sixth of the time, 10 s at most) and at the end of the load."""
    samples: list[tuple[float, float]] = []  # (seconds since "go", RSS)
    done = threading.Event()

    def sample() -> None:
        started = time.monotonic()
        while not done.wait(0.5):
            samples.append((time.monotonic() - started, rss_mb(ps)))

    sampler = threading.Thread(target=sample, name="load-rss-sampler", daemon=True)
    sampler.start()
    for proc in clients:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    deadline = time.monotonic() + seconds + RPC_TIMEOUT_S + 60
    results = []
    try:
        for proc in clients:  # reading each one's output as it comes: a full pipe would block its client
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise SystemExit(f"a client failed with exit code {proc.returncode}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        done.set()
        sampler.join(10)
    warm = min(10.0, seconds / 6)
    loaded = [rss for t, rss in samples if t <= seconds] or [0.0]
    return results, {"ps_rss_peak_mb": max(rss for _, rss in samples),
                     "ps_rss_after_warmup_mb": next((rss for t, rss in samples if t >= warm), loaded[-1]),
                     "ps_rss_loaded_end_mb": loaded[-1]}


def settled(ps: psutil.Process, threads: int, timeout: float = 30.0) -> tuple[float, int]:
    """The PS's RSS (MB) and thread count once it closed the clients' connections (its thread count
    back to `threads`), or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while ps.num_threads() > threads and time.monotonic() < deadline:
        time.sleep(0.2)  # polling the count; the deadline only bounds the wait
    return rss_mb(ps), ps.num_threads()


def check_updates(client: PSClient, tables: TableClient, results: list[dict]) -> dict:
    """Values that differ from what the acknowledged pushes imply: lost or doubled updates."""
    dense_pushes = sum(r["dense_pushes"] for r in results)
    pushes = np.zeros(ID_SPACE, np.int64)
    for r in results:
        np.add.at(pushes, np.asarray(r["ids"], np.int64), np.asarray(r["id_pushes"], np.int64))
    _, values = client.push_pull({}, [VAR]).wait(RPC_TIMEOUT_S)
    dense = np.concatenate([np.asarray(array).reshape(-1) for _, array in values])
    touched = np.flatnonzero(pushes).astype(np.int64)
    rows = tables.lookup(TABLE, touched) if touched.size else np.zeros((0, DIM), np.float32)
    wrong_dense = int(np.count_nonzero(dense != -float(dense_pushes)))
    wrong_rows = int(np.count_nonzero(rows != -pushes[touched, None].astype(np.float32)))
    return {"dense_pushes": dense_pushes, "row_pushes": int(pushes.sum()), "lost_or_doubled": wrong_dense + wrong_rows}


def run(args: argparse.Namespace) -> dict:
    dense_values = int(args.dense_mb * 2**20) // 4
    ps_proc = subprocess.Popen([sys.executable, "-m", "paramserver", "--log-level", "WARNING", "node", "--role", "ps",
                                "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    clients: list[subprocess.Popen] = []
    try:
        line = read_line(ps_proc, START_TIMEOUT_S)
        if not line.startswith("PARAMSERVER_READY"):
            raise SystemExit(f"the PS did not start: {line!r}")
        address, ps = line.split()[-1], psutil.Process(ps_proc.pid)
        client, tables = connect(address, args.transport, dense_values, worker=args.clients)
        tables.lookup(TABLE, np.arange(ID_SPACE, dtype=np.int64))  # every row exists: no push is dropped as unknown
        rss_start, threads_start = rss_mb(ps), ps.num_threads()
        clients = start_clients(args, address, dense_values)
        results, rss_loaded = collect(clients, ps, args.seconds)
        rss_end, threads_end = settled(ps, threads_start)
        checked = check_updates(client, tables, results)
        client.close()
    finally:
        for proc in [*clients, ps_proc]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
    latencies = np.array([ms for r in results for ms in r["latencies"]])
    errors: dict[str, int] = {}
    for r in results:
        for name, count in r["errors"].items():
            errors[name] = errors.get(name, 0) + count
    return {"bench": "load", "clients": args.clients, "seconds": args.seconds, "transport": args.transport,
            "dense_mb": args.dense_mb, "ids_per_request": args.ids, "requests": int(latencies.size),
            "errors": sum(errors.values()), "error_kinds": errors,
            "requests_per_s": round(latencies.size / args.seconds, 1),
            "p50_ms": round(float(np.percentile(latencies, 50)), 1) if latencies.size else None,
            "p99_ms": round(float(np.percentile(latencies, 99)), 1) if latencies.size else None,
            "ps_rss_start_mb": rss_start, **rss_loaded, "ps_rss_end_mb": rss_end,
            "ps_threads_start": threads_start, "ps_threads_end": threads_end, **checked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the clients send (default 60)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent client processes (default 32)")
    parser.add_argument("--dense-mb", type=float, default=2.0, help="size of the dense variable (default 2 MB)")
    parser.add_argument("--ids", type=int, default=256, help="distinct ids per request (default 256)")
    parser.add_argument("--transport", choices=["tcp", "shm", "grpc"], default="tcp",
                        help="the tensor stream over TCP (default), shared memory, or gRPC only")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--dense-values", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        run_client(args)
    else:
        print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
