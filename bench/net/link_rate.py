"""The shaping check: how fast one TCP connection moves bytes from one host of the testbed to another.

A receiver in one host counts the bytes of one connection, from the first to the last; a sender in the
other sends 1 MiB buffers for a fixed time. Python sockets, no iperf3: the rate is what a Python process
pinned to one core reaches, which is also what limits the nodes' own transfers. The achieved rate is
payload bytes: TCP/IP headers take about 4% of a shaped link (1448 of each 1514-byte frame).

As a script (run by `measure` inside the hosts' namespaces):

    python bench/net/link_rate.py receive --bind 10.79.0.2 --port 5201 --timeout 30
    python bench/net/link_rate.py send --to 10.79.0.2 --port 5201 --seconds 3
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

PORT = 5201
CHUNK = 1 << 20
CONNECT_WAIT_S = 10  # the receiver may still be starting (python, in a fresh namespace)


def receive(bind: str, port: int, timeout: float) -> dict:
    with socket.create_server((bind, port)) as server:
        server.settimeout(timeout)
        conn, _ = server.accept()
    with conn:
        conn.settimeout(timeout)
        buffer, received, first = bytearray(CHUNK), 0, None
        while count := conn.recv_into(buffer):
            first = first or time.perf_counter()
            received += count
        seconds = time.perf_counter() - first if first else 0.0
    return {
        "received_bytes": received,
        "seconds": round(seconds, 3),
        "gbit_s": round(received * 8 / seconds / 1e9, 3) if seconds else 0.0,
    }


def connect(address: str, port: int) -> socket.socket:
    deadline = time.monotonic() + CONNECT_WAIT_S
    while True:
        try:
            return socket.create_connection((address, port), timeout=CONNECT_WAIT_S)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def send(address: str, port: int, seconds: float) -> dict:
    data, sent = bytes(CHUNK), 0
    with connect(address, port) as conn:
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            conn.sendall(data)
            sent += len(data)
    return {"sent_bytes": sent}


def measure(net, sender, receiver, seconds: float = 3.0) -> float:
    """Gbit/s of payload from host `sender` to host `receiver` of testbed `net`, each on its own CPUs."""
    python, script = sys.executable, str(Path(__file__).resolve())
    deadline = seconds + 2 * CONNECT_WAIT_S
    with tempfile.TemporaryDirectory(prefix="psnet-rate-") as folder:
        out = Path(folder) / "receiver.out"
        started = [
            net.start(
                receiver,
                [
                    python,
                    script,
                    "receive",
                    "--bind",
                    receiver.address,
                    "--port",
                    str(PORT),
                    "--timeout",
                    str(deadline),
                ],
                env=None,
                out=out,
            )
        ]
        try:
            started.append(
                net.start(
                    sender,
                    [python, script, "send", "--to", receiver.address, "--port", str(PORT), "--seconds", str(seconds)],
                    env=None,
                    out=Path(folder) / "sender.out",
                )
            )
            for proc in reversed(started):
                proc.wait(deadline)
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"the rate check took over {deadline} s: {out.read_text()[-2000:]}") from error
        finally:
            for proc in started:
                net.stop(proc)  # a process that has exited is only forgotten
        lines = [line for line in out.read_text().splitlines() if line.startswith("{")]
        if not lines:
            raise RuntimeError(f"the rate check's receiver printed no result: {out.read_text()[-2000:]}")
        return json.loads(lines[-1])["gbit_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="side", required=True)
    rx = sub.add_parser("receive")
    rx.add_argument("--bind", required=True)
    rx.add_argument("--port", type=int, default=PORT)
    rx.add_argument("--timeout", type=float, default=30.0)
    tx = sub.add_parser("send")
    tx.add_argument("--to", required=True)
    tx.add_argument("--port", type=int, default=PORT)
    tx.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    result = (
        receive(args.bind, args.port, args.timeout)
        if args.side == "receive"
        else send(args.to, args.port, args.seconds)
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
