"""Transport throughput: pull and push of a 64 MB dense variable between one worker and one PS, over
TCP and over shared memory, next to a raw-socket baseline and a memcpy baseline, all in one run.

The PS is a real process (`paramserver node --role ps`); this process is the worker, calling it
through PSClient (no torch). SGD, so a push costs mostly its transfer. The raw-socket baseline moves
the same bytes the same way between two processes over a local TCP socket: a small request then
64 MB back (pull), 64 MB then a small reply (push). Prints one JSON line: GB/s of each, and ratios
(targets: TCP >= 60% of the raw socket, shared memory >= 50% of memcpy).

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

import numpy as np

from paramserver.client.ps_client import PSClient
from paramserver.transport.grpc_transport import GrpcChannel

SGD = {"name": "sgd", "hyper": {"lr": 1e-9}}
_SMALL = 64  # bytes of a raw-socket request or acknowledgement


def best_gbps(run, nbytes: int, repeats: int) -> float:
    """GB/s of the fastest of `repeats` runs (after one warm-up): the least disturbed by other load."""
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return round(nbytes / min(times) / 1e9, 3)


def start_ps(max_message_bytes: int) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PARAMSERVER_OPTIONS=json.dumps({"max_message_bytes": max_message_bytes}))
    proc = subprocess.Popen([sys.executable, "-m", "paramserver", "--log-level", "WARNING", "node", "--role", "ps",
                             "--index", "0", "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("PARAMSERVER_READY"):
        proc.kill()
        raise SystemExit(f"PS did not start: {line!r}")
    return proc, line.split()[-1]


def ps_figures(address: str, values: np.ndarray, shared_memory: bool, max_message_bytes: int,
               repeats: int) -> dict:
    channel = GrpcChannel(address, max_message_bytes, use_stream=True, use_shared_memory=shared_memory)
    client = PSClient([channel], 120.0)
    client.connect(30.0)
    name = f"w_{'shm' if shared_memory else 'tcp'}"
    try:
        client.register(name, SGD, {name: values}).wait(120.0)
        grad = np.full_like(values, 1e-3)
        pull = best_gbps(lambda: client.push_pull({}, [name]).wait(120.0), values.nbytes, repeats)
        push = best_gbps(lambda: client.push_pull({name: grad}, []).wait(120.0), values.nbytes, repeats)
    finally:
        client.close()
    return {"pull": pull, "push": push}


def _socket_peer(port: int, nbytes: int, rounds: int) -> None:
    """The raw-socket baseline's other process: answers each pull with `nbytes`, each push with a few."""
    data = np.ones(nbytes, np.uint8)
    inbox = bytearray(nbytes)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):  # pulls: a small request, the whole payload back
            _receive(sock, memoryview(inbox)[:_SMALL])
            sock.sendall(data)
        for _ in range(rounds):  # pushes: the whole payload, a small reply
            _receive(sock, memoryview(inbox))
            sock.sendall(bytes(_SMALL))


def _receive(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("peer closed")
        got += n


def socket_figures(nbytes: int, repeats: int) -> dict:
    rounds = repeats + 1
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = multiprocessing.get_context("fork").Process(target=_socket_peer,
                                                            args=(listener.getsockname()[1], nbytes, rounds))
        peer.start()
        sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data, inbox = np.ones(nbytes, np.uint8), bytearray(nbytes)

    def pull() -> None:
        sock.sendall(bytes(_SMALL))
        _receive(sock, memoryview(inbox))

    def push() -> None:
        sock.sendall(data)
        _receive(sock, memoryview(inbox)[:_SMALL])

    try:
        return {"pull": best_gbps(pull, nbytes, repeats), "push": best_gbps(push, nbytes, repeats)}
    finally:
        sock.close()
        peer.join(30)


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    source, target = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    return best_gbps(lambda: np.copyto(target, source), nbytes, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="size of the variable in MB (default 64)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs of each figure; the best counts")
    parser.add_argument("--max-message-bytes", type=int, default=1 << 30,
                        help="the PS's and the worker's max_message_bytes (smaller: payloads go in parts)")
    args = parser.parse_args()
    nbytes = args.mb << 20
    values = np.linspace(-1, 1, nbytes // 4, dtype=np.float32)
    proc, address = start_ps(args.max_message_bytes)
    try:
        tcp = ps_figures(address, values, False, args.max_message_bytes, args.repeats)
        shm = ps_figures(address, values, True, args.max_message_bytes, args.repeats)
    finally:
        proc.terminate()
        proc.wait(30)
    raw = socket_figures(nbytes, args.repeats)
    memcpy = memcpy_gbps(nbytes, args.repeats)
    result = {"bench": "transport", "mb": args.mb, "max_message_bytes": args.max_message_bytes,
              "tcp_pull_gbps": tcp["pull"], "tcp_push_gbps": tcp["push"],
              "shm_pull_gbps": shm["pull"], "shm_push_gbps": shm["push"],
              "socket_pull_gbps": raw["pull"], "socket_push_gbps": raw["push"], "memcpy_gbps": memcpy}
    for way in ("pull", "push"):
        result[f"tcp_{way}_vs_socket"] = round(tcp[way] / raw[way], 3)
        result[f"shm_{way}_vs_memcpy"] = round(shm[way] / memcpy, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
