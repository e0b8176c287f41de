"""Forks a process whose gRPC is busy, as a worker's is when a DataLoader forks its worker processes.

The process serves the coordinator over gRPC and calls it from a heartbeat thread (every 10 ms)
and from a second thread (back to back), as worker 0 of a cluster does; then the main thread
forks --forks times. Each child only reports how many threads it has (a fork copies just the
calling thread: any other thread was started in the child, by a fork handler) and exits. Prints
one JSON line: {"child_threads": [...]}.
"""

import argparse
import json
import os
import threading

import paramserver  # noqa: F401  - first, as `paramserver run` and `paramserver node` import it
from paramserver.base.config import Options
from paramserver.coordinator.coordinator_service import SERVICE as COORDINATOR
from paramserver.coordinator.coordinator_service import CoordinatorClient
from paramserver.node.coordinator_host import CoordinatorHost
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.wire import codec

parser = argparse.ArgumentParser()
parser.add_argument("--forks", type=int, default=10)
args = parser.parse_args()

options = Options()
host = CoordinatorHost(1, "127.0.0.1:0", options)
address = host.start()
client = CoordinatorClient(GrpcChannel(address, 1 << 20, use_stream=False, service_name=COORDINATOR), 0, 10.0,
                           heartbeat_s=0.01)
client.start()
client.wait_ready(10.0)
caller = GrpcChannel(address, 1 << 20, use_stream=False, service_name=COORDINATOR)
caller.wait_ready(10.0)
stopping = threading.Event()


def call_back_to_back() -> None:
    while not stopping.is_set():
        caller.call("Hello", codec.encode({}), 10.0).wait(10.0)


thread = threading.Thread(target=call_back_to_back, daemon=True)
thread.start()
counts = []
for _ in range(args.forks):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write_end, str(len(os.listdir("/proc/self/task"))).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as reply:
        counts.append(int(reply.read() or -1))  # -1: the child died before it could answer
    os.waitpid(pid, 0)
stopping.set()
thread.join()
caller.close()
client.stop()
host.stop(1.0)
print(json.dumps({"child_threads": counts}), flush=True)
