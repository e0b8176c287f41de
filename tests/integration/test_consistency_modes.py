"""Consistency modes end to end: real PS processes, workers as threads with their own connections."""

import copy
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests.ports import free_port
from tests.reference import batches, max_relative_error, mlp, twin
from tests.wait import finished

import paramserver as ps
from paramserver.base.config import ClusterSpec, NodeConfig, Options, Task
from paramserver.client.ps_client import PSClient
from paramserver.tables.embedding_table import initial_rows
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.worker.cluster import cluster_context

pytestmark = pytest.mark.cluster  # real PS processes


def worker_contexts(addresses, workers, mode, backups=0, schedule="", **options):
    """One Context per worker, as `paramserver.init()` builds them (worker 0 hosts the coordinator)."""
    cluster = ClusterSpec(ps=tuple(addresses), worker=tuple(f"127.0.0.1:{free_port()}" for _ in range(workers)))
    options = Options(**{"rpc_timeout_s": 30, "connect_timeout_s": 20, **options}, split_bytes=4096, mode=mode,
                      backup_workers=backups, mode_schedule=schedule)
    return [cluster_context(NodeConfig(cluster, Task("worker", i), options)) for i in range(workers)]


def observe(addresses):
    """Each shard's counters, read by a plain client."""
    client = PSClient([GrpcChannel(a, 1 << 20, use_stream=False) for a in addresses], 10)
    client.connect(10)
    try:
        return client.shard_stats()
    finally:
        client.close()


def run_workers(contexts, body):
    """Run body(ctx) on a thread per worker; re-raise the first failure."""
    errors = []

    def run(ctx):
        try:
            body(ctx)
        except BaseException as exc:
            errors.append(exc)
        finally:
            ctx.shutdown()  # as a worker process does when its script ends
    threads = [threading.Thread(target=run, args=(ctx,), name=f"test-worker{ctx.worker_index}") for ctx in contexts]
    for thread in threads:
        thread.start()
    for thread in threads:
        finished(thread, f"{thread.name}'s training body", timeout=120)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("name, kwargs", [("SGD", dict(lr=0.05, momentum=0.9)), ("Adam", dict(lr=1e-3)),
                                          ("Adagrad", dict(lr=0.05))])
def test_sync_equals_single_process_training_on_the_summed_batch(procs, name, kwargs):
    workers, batch, steps = 2, 8, 50
    addresses = [procs.start_ps(i)[1] for i in range(2)]
    reference = mlp()
    models = [twin(reference) for _ in range(workers)]
    data = batches(steps, batch=workers * batch)
    opt_ref = getattr(torch.optim, name)(reference.parameters(), **kwargs)
    for x, y in data:
        opt_ref.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt_ref.step()

    def train(ctx):
        model = models[ctx.worker_index]
        opt = getattr(ps.optim, name)(model.parameters(), context=ctx, **kwargs)
        for x, y in data:
            mine = slice(ctx.worker_index * batch, (ctx.worker_index + 1) * batch)
            opt.zero_grad()
            F.cross_entropy(model(x[mine]), y[mine]).backward()
            opt.step()
    run_workers(worker_contexts(addresses, workers, "sync"), train)
    for model in models:  # every worker ends on the PS's values: the same model
        assert max_relative_error(model, reference) < 1e-5


@pytest.mark.parametrize("num_ps", [2, 3])  # with 3, two shards hold only embedding rows
def test_sync_with_an_embedding_table_equals_single_process_training_on_the_summed_batch(procs, num_ps):
    workers, batch, steps, vocab, dim = 2, 8, 30, 40, 4
    addresses = [procs.start_ps(i)[1] for i in range(num_ps)]
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, vocab, (workers * batch, 3), generator=g), torch.randn(workers * batch, generator=g))
            for _ in range(steps)]
    torch.manual_seed(0)
    head = torch.nn.Linear(3 * dim, 1)
    reference, reference_head = torch.nn.Embedding(vocab, dim, sparse=True), copy.deepcopy(head)
    with torch.no_grad():
        reference.weight.copy_(torch.from_numpy(initial_rows(np.arange(vocab), dim, {"kind": "normal", "std": 0.1})))
    dense_opt = torch.optim.Adam(reference_head.parameters(), lr=0.01)
    sparse_opt = torch.optim.SparseAdam(reference.parameters(), lr=0.01)
    for ids, y in data:
        dense_opt.zero_grad()
        sparse_opt.zero_grad()
        F.mse_loss(reference_head(reference(ids).flatten(1)).squeeze(1), y).backward()
        dense_opt.step()
        sparse_opt.step()
    trained = {}

    def train(ctx):
        embedding, my_head = ps.nn.HashEmbedding(dim, std=0.1, name="t"), copy.deepcopy(head)
        opt = ps.optim.Adam(list(embedding.parameters()) + list(my_head.parameters()), lr=0.01, context=ctx)
        mine = slice(ctx.worker_index * batch, (ctx.worker_index + 1) * batch)
        for ids, y in data:
            opt.zero_grad()
            F.mse_loss(my_head(embedding(ids[mine]).flatten(1)).squeeze(1), y[mine]).backward()
            opt.step()
        trained[ctx.worker_index] = (embedding.lookup(torch.arange(vocab)).detach(), my_head.weight.detach())
    run_workers(worker_contexts(addresses, workers, "sync"), train)
    for rows, weight in trained.values():
        torch.testing.assert_close(rows, reference.weight.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(weight, reference_head.weight.detach(), rtol=1e-4, atol=1e-5)


def _train_steps(steps, delays, log, mode_of_ctx=None):
    def train(ctx):
        model = mlp(sizes=(784, 16, 10))
        opt = ps.optim.SGD(model.parameters(), lr=0.01, context=ctx)
        for (x, y) in batches(steps, seed=ctx.worker_index):
            time.sleep(delays[ctx.worker_index])
            log.append((time.monotonic(), ctx.worker_index, "start", opt.steps))
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            log.append((time.monotonic(), ctx.worker_index, "push", opt.steps + 1))
            opt.step()
    return train


def test_ssp_keeps_the_fast_worker_at_most_k_steps_ahead(procs):
    addresses = [procs.start_ps()[1]]
    log = []
    contexts = worker_contexts(addresses, 2, "ssp:2")
    run_workers(contexts, _train_steps(12, [0.0, 0.15], log))
    slow_pushes, lead = 0, []
    for _, worker, event, step in sorted(log):
        if worker == 1 and event == "push":
            slow_pushes = step  # the slow worker's push is applied after this moment
        elif worker == 0 and event == "start":
            lead.append(step - slow_pushes)  # steps the fast worker has done beyond the slow one
    assert max(lead) == 2  # the fast worker reached exactly K ahead, never more


def test_backup_workers_leave_the_straggler_behind_and_count_its_late_pushes(procs):
    """Worker 2 starts late (its first push joins the step under way: nothing dropped), then falls
    behind (its later pushes are for steps already applied: dropped and counted)."""
    addresses = [procs.start_ps()[1]]
    contexts = worker_contexts(addresses, 3, "sync", backups=1)
    fast_steps = {0: 0, 1: 0}
    progress = threading.Condition()
    dropped = {}

    def train(ctx):
        model = mlp(sizes=(784, 16, 10))
        opt = ps.optim.SGD(model.parameters(), lr=0.01, context=ctx)
        for step, (x, y) in enumerate(batches(15, seed=ctx.worker_index)):
            if ctx.worker_index == 2:  # the straggler: each push only after the others went 4 steps on
                with progress:
                    assert progress.wait_for(lambda: min(fast_steps.values()) >= 4 * (step + 1) or
                                             min(fast_steps.values()) == 15, 60)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if ctx.worker_index == 2 and step == 0:
                dropped["first"] = ctx.staleness()["dropped"]
            if ctx.worker_index < 2:
                with progress:
                    fast_steps[ctx.worker_index] = step + 1
                    progress.notify_all()
        dropped[ctx.worker_index] = ctx.staleness()["dropped"]
    run_workers(contexts, train)
    stats = observe(addresses)[0]
    assert dropped["first"] == 0  # a late start drops nothing
    assert dropped[2] > 0 and stats["dropped_late"] == dropped[0] + dropped[1] + dropped[2]
    assert stats["pushes"] + stats["dropped_late"] == 45
    assert stats["sync_step"] >= 15


def test_switching_async_to_sync_while_training_loses_no_push(procs):
    addresses = [procs.start_ps(i)[1] for i in range(2)]
    contexts = worker_contexts(addresses, 2, "async", schedule="sync@10")
    log = []
    run_workers(contexts, _train_steps(20, [0.0, 0.01], log))
    for stats in observe(addresses):
        assert stats["mode"] == "sync"
        assert stats["pushes"] == 40 and stats["dropped_late"] == 0
        assert stats["sync_step"] == 10  # the 10 steps after the switch, in lockstep: one update each


def test_only_the_chief_switches_modes(procs):
    addresses = [procs.start_ps()[1]]
    contexts = worker_contexts(addresses, 2, "async")
    with pytest.raises(ps.ParamServerError, match="only the chief"):
        contexts[1].set_mode("sync")
    for ctx in reversed(contexts):
        ctx.shutdown()


def silence(ctx):
    """Worker `ctx` dies as far as the others can tell: no heartbeat, no leave."""
    ctx.coordinator._stopping.set()
    finished(ctx.coordinator._thread, f"worker {ctx.worker_index}'s heartbeat thread to stop")


@pytest.mark.parametrize("wait", ["push", "barrier"])
def test_a_wait_that_needs_a_dead_worker_fails_at_once_naming_it(procs, wait):
    """No deadline decides (the PS would wait 60 s, the worker 600 s): the coordinator finds worker 1 silent for
    3 s and the wait fails with UNAVAILABLE naming it."""
    addresses = [procs.start_ps()[1]]
    contexts = worker_contexts(addresses, 2, "sync", rpc_timeout_s=600, heartbeat_timeout_s=3)
    models = [mlp(sizes=(8, 4)) for _ in contexts]
    opts = [ps.optim.SGD(m.parameters(), lr=0.1, context=ctx) for m, ctx in zip(models, contexts)]
    silence(contexts[1])
    try:
        with pytest.raises(ps.UnavailableError, match="worker 1 is gone"):
            if wait == "push":
                for param in models[0].parameters():
                    param.grad = torch.ones_like(param)
                opts[0].step()  # a sync step that needs worker 1's push
            else:
                contexts[0].barrier("evaluate")
    finally:
        for ctx in reversed(contexts):
            ctx.shutdown()
