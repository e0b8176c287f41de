"""A 20 MB variable through PS that allow 1 MB messages: registration, steps, pull, a checkpoint and
its restore all travel in parts (TCP, shared memory, gRPC) and give plain torch's numbers."""

import json

import pytest
import torch
from tests.reference import train

import paramserver as ps
from paramserver.base.config import ClusterSpec, NodeConfig, Options, Task

pytestmark = pytest.mark.cluster  # real PS processes

LIMIT = 1 << 20
TRANSPORTS = {"shm": dict(use_stream=True, shared_memory=True), "tcp": dict(use_stream=True, shared_memory=False),
              "grpc": dict(use_stream=False)}


def big_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(2560, 2048)  # 5.2 M float32 weights: 21 MB, plus a bias


def data(steps: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 2560, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(steps)]


def start_ps(procs, count: int, directory, resume: bool = False) -> list[str]:
    options = json.dumps({"max_message_bytes": LIMIT, "checkpoint_dir": str(directory), "resume": resume})
    return [procs.start_ps(i, PARAMSERVER_OPTIONS=options)[1] for i in range(count)]


def join(addresses, directory, transport):
    cluster = ClusterSpec(ps=tuple(addresses), worker=("127.0.0.1:0",))
    options = Options(connect_timeout_s=20, max_message_bytes=LIMIT, checkpoint_dir=str(directory),
                      **TRANSPORTS[transport])
    return ps.init(NodeConfig(cluster, Task("worker", 0), options))


def same(model: torch.nn.Module, reference: torch.nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize("transport, num_ps", [("shm", 1), ("tcp", 1), ("grpc", 1), ("tcp", 2)])
def test_a_variable_twenty_times_the_message_limit_trains_saves_and_restores(procs, fresh_context, tmp_path,
                                                                               transport, num_ps):
    steps = data(3)
    reference = big_model(0)
    train(reference, torch.optim.SGD(reference.parameters(), lr=0.5), steps)

    model = big_model(0)
    context = join(start_ps(procs, num_ps, tmp_path), tmp_path, transport)
    opt = ps.optim.SGD(model.parameters(), lr=0.5)
    train(model, opt, steps)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt.pull()  # the values come back from the PS
    assert same(model, reference)
    context.shutdown(completed=True)  # the final checkpoint

    for proc in procs.started:  # a fresh cluster, from that checkpoint
        proc.kill()
    restored = big_model(7)  # other initial values: the PS's restored ones win
    join(start_ps(procs, num_ps, tmp_path, resume=True), tmp_path, transport)
    ps.optim.SGD(restored.parameters(), lr=0.5)
    assert same(restored, reference)
