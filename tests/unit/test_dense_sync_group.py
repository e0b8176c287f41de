"""optim/dense_sync.py with two ranks in one process (threads, a real gloo group on 127.0.0.1): the
averages divide by the real contributors, a finished rank answers until every rank stepped out."""

import threading
import time
from types import SimpleNamespace

import torch
from tests.wait import finished

from paramserver.base.config import Options
from paramserver.coordinator.membership import Coordinator
from paramserver.optim.dense_sync import PUBLISHED_KEY, DenseSync

LR = 0.5


class Published:
    """The coordinator as a worker other than the host reads it."""

    incarnation = "test"

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def published(self, key: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while key not in self.coordinator.view().get("published", {}) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.coordinator.view()["published"][key]


def worker(rank: int, coordinator: Coordinator, grads: list[dict], results: dict) -> None:
    """Rank `rank` steps once per entry of `grads` ({name: gradient or None}), then steps out."""
    context = SimpleNamespace(worker_index=rank, num_workers=2, options=Options(rpc_timeout_s=60),
                              coordinator=Published(coordinator), address="127.0.0.1:0", rollback=None,
                              coordinator_host=SimpleNamespace(address="127.0.0.1:0", coordinator=coordinator),
                              dense_group=None, rejoined=False, is_chief=rank == 0, checkpointer=None)
    params = {"w": torch.nn.Parameter(torch.full((2, 3), float(rank))), "b": torch.nn.Parameter(torch.zeros(3))}
    optimizer = SimpleNamespace(context=context, kind="sgd", _vars=[(f"opt0.{n}", p) for n, p in params.items()],
                                param_groups=[{"params": list(params.values()), "lr": LR}])
    sync = DenseSync(optimizer, optimizer._vars)
    results[rank, "start"] = {n: p.detach().clone() for n, p in params.items()}
    for step in grads:
        for name, param in params.items():
            param.grad = None if step[name] is None else step[name].clone()  # the step averages it in place
        sync.step()
    context.dense_group.join()
    results[rank] = {n: p.detach().clone() for n, p in params.items()}


def test_a_finished_rank_answers_and_averages_divide_by_the_real_contributors():
    coordinator = Coordinator(2)
    g = torch.Generator().manual_seed(3)
    w = [torch.randn(2, 3, generator=g) for _ in range(4)]
    b = [torch.randn(3, generator=g) for _ in range(4)]
    steps = {0: [{"w": w[0], "b": b[0]}, {"w": w[1], "b": None}, {"w": w[2], "b": b[2]}],
             1: [{"w": w[3], "b": b[3]}]}  # rank 1 has one batch, then answers rank 0's steps
    results: dict = {}
    threads = [threading.Thread(target=worker, args=(rank, coordinator, steps[rank], results)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        finished(thread, f"rank {threads.index(thread)} to finish its steps", timeout=120)
    assert 0 in results and 1 in results, "a rank did not finish"
    assert coordinator.view()["published"][PUBLISHED_KEY].startswith("127.0.0.1:")
    # worker 0's initial values, broadcast: both start equal
    assert torch.equal(results[1, "start"]["w"], torch.zeros(2, 3))
    want_w = -LR * ((w[0] + w[3]) / 2 + w[1] + w[2])
    want_b = -LR * ((b[0] + b[3]) / 2 + b[2])  # step 2: nobody had a gradient for b, torch skips it
    for rank in (0, 1):
        torch.testing.assert_close(results[rank]["w"], want_w, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(results[rank]["b"], want_b, rtol=1e-6, atol=1e-6)
    assert torch.equal(results[0]["w"], results[1]["w"]) and torch.equal(results[0]["b"], results[1]["b"])
