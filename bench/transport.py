"""Transport throughput: pull and push of a 64 MB dense variable between one worker and one PS, over
TCP and over shared memory (and gRPC, for reference), next to a raw-socket baseline and a memcpy
baseline, all measured in the same rounds of one run (each round times every figure once).

The PS is a real process (`paramserver node --role ps`); this process is the worker, calling it
through PSClient (no torch). SGD, so a push costs mostly its transfer. The raw-socket baseline moves
the same bytes the same way between two processes over a local TCP socket: a small request then
64 MB back (pull), 64 MB then a small reply (push). Prints one JSON line: GB/s of each, ratios (targets: TCP >= 60% of the
raw socket, shared memory >= 50% of memcpy), and the PS's CPU milliseconds per pull and push on the
stream (`*_ps_cpu_ms`, /proc: Linux; the mean over the rounds), steadier than GB/s on a shared machine.

    python bench/transport.py [--mb 64] [--repeats 10] [--max-message-bytes N]
"""

import argparse
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from paramserver.client.ps_client import PSClient
from paramserver.transport.grpc_transport import GrpcChannel

SGD = {"name": "sgd", "hyper": {"lr": 1e-9}}
_SMALL = 64  # bytes of a raw-socket request or acknowledgement


def timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def ps_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def best_gbps(runs: dict, nbytes: int, repeats: int, pid: int) -> tuple[dict, dict]:
    """GB/s of each run, the fastest of `repeats` rounds (after a warm-up one), and the PS's (`pid`) CPU
    milliseconds per run, the mean over the rounds. Each round times every run once, so that the
    machine's load drifts alike for all of them and their ratios hold."""
    best = {name: float("inf") for name in runs}
    cpu = dict.fromkeys(runs, 0.0)
    for round_ in range(repeats + 1):
        for name, run in runs.items():
            before = ps_cpu_s(pid)
            took = timed(run)
            if round_:
                best[name] = min(best[name], took)
                cpu[name] += ps_cpu_s(pid) - before
    gbps = {name: round(nbytes / took / 1e9, 3) for name, took in best.items()}
    return gbps, {name: round(seconds / repeats * 1e3, 1) for name, seconds in cpu.items()}


def start_ps(max_message_bytes: int) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PARAMSERVER_OPTIONS=json.dumps({"max_message_bytes": max_message_bytes}))
    proc = subprocess.Popen([sys.executable, "-m", "paramserver", "--log-level", "WARNING", "node", "--role", "ps",
                             "--index", "0", "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("PARAMSERVER_READY"):
        proc.kill()
        raise SystemExit(f"PS did not start: {line!r}")
    return proc, line.split()[-1]


TRANSPORTS = {"tcp": dict(use_stream=True, use_shared_memory=False), "shm": dict(use_stream=True),
              "grpc": dict(use_stream=False)}


def ps_runs(address: str, values: np.ndarray, transport: str, max_message_bytes: int) -> tuple[dict, PSClient]:
    """Pull and push of `values` through a PS client on `transport`, as runs for best_gbps."""
    client = PSClient([GrpcChannel(address, max_message_bytes, **TRANSPORTS[transport])], 120.0)
    client.connect(30.0)
    name = f"w_{transport}"
    client.register(name, SGD, {name: values}).wait(120.0)
    grad = np.full_like(values, 1e-3)
    return {f"{transport}_pull": lambda: client.push_pull({}, [name]).wait(120.0),
            f"{transport}_push": lambda: client.push_pull({name: grad}, []).wait(120.0)}, client


def _socket_peer(port: int, nbytes: int) -> None:
    """The raw-socket baseline's other process: a pull request (b"L") gets `nbytes` back, a push (b"P")
    is followed by `nbytes`, answered with a few bytes; until the connection closes."""
    data = np.ones(nbytes, np.uint8)
    inbox = bytearray(max(nbytes, _SMALL))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:
                _receive(sock, memoryview(inbox)[:_SMALL])
            except ConnectionError:
                return
            if inbox[0] == ord("L"):
                sock.sendall(data)
            else:
                _receive(sock, memoryview(inbox)[:nbytes])
                sock.sendall(bytes(_SMALL))


def _receive(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("peer closed")
        got += n


def socket_runs(nbytes: int) -> tuple[dict, socket.socket, multiprocessing.Process]:
    """Pull and push of `nbytes` over a local TCP socket to another process, as runs for best_gbps."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = multiprocessing.get_context("fork").Process(target=_socket_peer,
                                                            args=(listener.getsockname()[1], nbytes))
        peer.start()
        sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data, inbox = np.ones(nbytes, np.uint8), bytearray(nbytes)
    pull_request, push_request = b"L" * _SMALL, b"P" * _SMALL

    def pull() -> None:
        sock.sendall(pull_request)
        _receive(sock, memoryview(inbox))

    def push() -> None:
        sock.sendall(push_request)
        sock.sendall(data)
        _receive(sock, memoryview(inbox)[:_SMALL])

    return {"socket_pull": pull, "socket_push": push}, sock, peer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="size of the variable in MB (default 64)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs of each figure; the best counts")
    parser.add_argument("--max-message-bytes", type=int, default=1 << 30,
                        help="the PS's and the worker's max_message_bytes (smaller: payloads go in parts)")
    args = parser.parse_args()
    nbytes = args.mb << 20
    values = np.linspace(-1, 1, nbytes // 4, dtype=np.float32)
    source, target = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    runs, clients = {"memcpy": lambda: np.copyto(target, source)}, []
    proc, address = start_ps(args.max_message_bytes)
    sock, peer = None, None
    try:
        for transport in TRANSPORTS:
            transport_runs, client = ps_runs(address, values, transport, args.max_message_bytes)
            runs.update(transport_runs)
            clients.append(client)
        socket_run, sock, peer = socket_runs(nbytes)
        runs.update(socket_run)
        gbps, ps_cpu_ms = best_gbps(runs, nbytes, args.repeats, proc.pid)
    finally:
        for client in clients:
            client.close()
        if sock is not None:
            sock.close()
            peer.join(30)
        proc.terminate()
        proc.wait(30)
    result = {"bench": "transport", "mb": args.mb, "max_message_bytes": args.max_message_bytes,
              **{f"{name}_gbps": value for name, value in gbps.items()},
              **{f"{name}_ps_cpu_ms": value for name, value in ps_cpu_ms.items() if name.startswith(("tcp", "shm"))}}
    for way in ("pull", "push"):
        result[f"tcp_{way}_vs_socket"] = round(gbps[f"tcp_{way}"] / gbps[f"socket_{way}"], 3)
        result[f"shm_{way}_vs_memcpy"] = round(gbps[f"shm_{way}"] / gbps["memcpy"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
