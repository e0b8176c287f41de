"""bfloat16 and float16 models on real PS processes against plain torch with float32 master weights.

The reference keeps float32 masters, runs forward and backward on a copy in the model's dtype,
upcasts the gradients, steps torch.optim on the masters and casts them back, which is what the PS
does. SGD with a power-of-two learning rate is bit-exact (lr * g is exact in float32, so the PS's
multiply-then-add rounds as torch's fused multiply-add does); Adam's float32 arithmetic differs from
torch's in the last bit now and then, so there each value is asserted equal or one step of its
dtype apart (adjacent representable values)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests.reference import batches, mlp

import paramserver as ps
from paramserver.base.config import ClusterSpec, NodeConfig, Options, Task
from paramserver.tables.embedding_table import initial_rows
from paramserver.wire import codec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIMIZERS = {"sgd": ("SGD", dict(lr=2 ** -4, momentum=0.5), 0),  # (class, arguments, steps apart allowed)
              "adam": ("Adam", dict(lr=1e-3), 1)}
SIZES, STEPS = (784, 64, 10), 10


def join(addresses, **options):
    cluster = ClusterSpec(ps=tuple(addresses), worker=("127.0.0.1:0",))
    return ps.init(NodeConfig(cluster, Task("worker", 0), Options(connect_timeout_s=20, **options)))


def reference(model, name, kwargs, data, dtype, overlap=False):
    """Train `model` (in `dtype`) in plain torch with float32 masters; with `overlap`, step t's forward
    sees the values of update t-2, as in overlap mode."""
    master = [p.detach().float().clone() for p in model.parameters()]
    opt = getattr(torch.optim, name)(master, **kwargs)
    history = [[m.clone() for m in master]]
    for t, (x, y) in enumerate(data):
        if overlap:
            load(model, history[max(t - 1, 0)])
        model.zero_grad()
        F.cross_entropy(model(x.to(dtype)), y).backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        history.append([m.clone() for m in master])
        load(model, master)
    return model


@torch.no_grad()
def load(model, values):
    for p, value in zip(model.parameters(), values):
        p.copy_(value)  # rounds to nearest even, as the PS's pull


def train(model, opt, data, dtype):
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x.to(dtype)), y).backward()
        opt.step()


def steps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most representable values of their (16-bit) dtype between two tensors' elements."""
    def ordered(t):
        bits = t.detach().view(torch.int16).int()
        return torch.where(bits < 0, -32768 - bits, bits)  # sign-magnitude to a monotonic integer
    return int((ordered(a) - ordered(b)).abs().max())


@pytest.mark.cluster
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_half_model_trains_as_torch_with_float32_masters(procs, fresh_context, dtype, optimizer):
    join([procs.start_ps(i)[1] for i in range(2)], split_bytes=4096)  # the first layer splits over both
    name, kwargs, allowed = OPTIMIZERS[optimizer]
    model = mlp(sizes=SIZES).to(DTYPES[dtype])
    expected = reference(copy.deepcopy(model), name, kwargs, batches(STEPS), DTYPES[dtype])
    opt = getattr(ps.optim, name)(model.parameters(), **kwargs)
    train(model, opt, batches(STEPS), DTYPES[dtype])
    assert {p.shard for parts in opt.context.client.parts_of.values() for p in parts} == {0, 1}
    assert all(p.dtype == DTYPES[dtype] for p in model.parameters())
    assert max(steps_apart(p, q) for p, q in zip(model.parameters(), expected.parameters())) <= allowed
    moved = mlp(sizes=SIZES).to(DTYPES[dtype])
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), moved.parameters()))


@pytest.mark.cluster
def test_overlap_mode_trains_a_bfloat16_model_as_torch_one_update_behind(procs, fresh_context):
    join([procs.start_ps()[1]])
    kwargs = dict(lr=2 ** -4)
    model = mlp(sizes=SIZES).to(torch.bfloat16)
    expected = reference(copy.deepcopy(model), "SGD", kwargs, batches(STEPS), torch.bfloat16, overlap=True)
    opt = ps.optim.SGD(model.parameters(), overlap=True, **kwargs)
    train(model, opt, batches(STEPS), torch.bfloat16)
    opt.pull()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), expected.parameters()))


class CountingChannel:
    """A channel that counts the bytes of PushPull requests and replies."""

    def __init__(self, channel) -> None:
        self.channel, self.sent, self.received = channel, 0, 0

    def call(self, method, payload, timeout, owned=False):
        handle = self.channel.call(method, payload, timeout, owned)
        if method != "PushPull":
            return handle
        self.sent += codec.parts_size(payload) if isinstance(payload, list) else len(payload)
        wait, counter = handle.wait, self

        def counted(timeout):
            reply = wait(timeout)
            counter.received += len(reply)
            return reply
        handle.wait = counted
        return handle

    def __getattr__(self, name):
        return getattr(self.channel, name)


@pytest.mark.cluster
def test_a_bfloat16_model_moves_about_half_the_bytes_of_a_float32_one(procs, fresh_context):
    ctx = join([procs.start_ps()[1]])
    counters = ctx.client.channels = [CountingChannel(channel) for channel in ctx.client.channels]
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = mlp(sizes=SIZES).to(dtype)
        opt = ps.optim.SGD(model.parameters(), lr=0.01)
        before = [(c.sent, c.received) for c in counters]
        train(model, opt, batches(3), dtype)
        moved[dtype] = [sum(c.sent - s for c, (s, _) in zip(counters, before)),
                        sum(c.received - r for c, (_, r) in zip(counters, before))]
    pushed, pulled = (moved[torch.bfloat16][i] / moved[torch.float32][i] for i in range(2))
    assert 0.5 <= pushed < 0.52 and 0.5 <= pulled < 0.52, moved  # the headers do not halve


@pytest.mark.cluster
def test_a_gradient_in_another_dtype_than_registered_is_refused_over_the_wire(procs, fresh_context):
    ctx = join([procs.start_ps()[1]])
    model = mlp(sizes=(8, 4)).to(torch.bfloat16)
    opt = ps.optim.SGD(model.parameters(), lr=0.1)
    var = opt.variables[0]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ps.InvalidArgumentError, match="dtype float32, but .* travel as bfloat16"):
        ctx.client.push_pull({var: np.ones((4, 8), np.float32)}, [var]).wait(10)
    opt.pull()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert [stats["version"] for stats in ctx.client.shard_stats()] == [0]


@pytest.mark.cluster
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_half_embedding_table_trains_as_torch_on_float32_rows(procs, fresh_context, dtype):
    """Rows start as the PS's float32 initial values; lookups (direct and riding along a step) come
    back rounded to `dtype`, row gradients go out in it and update the float32 rows."""
    join([procs.start_ps(i)[1] for i in range(2)])
    lr, half = 2 ** -2, DTYPES[dtype]
    emb = ps.nn.HashEmbedding(4, init="normal", std=0.5, dtype=half)
    opt = ps.optim.SGD(emb.parameters(), lr=lr)
    steps = [torch.tensor(ids) for ids in ([1, 5, 9, 1000], [5, 7, 1000, 3], [9, 3, 2, 1])]  # distinct per batch
    master: dict[int, torch.Tensor] = {}
    for t, ids in enumerate(steps):
        opt.zero_grad()
        out = emb(ids)
        if t + 1 < len(steps):
            emb.prefetch(steps[t + 1])  # the next batch's rows ride along this step
        assert out.dtype == half
        (out.float() ** 2).sum().backward()
        opt.step()
        for i in ids.tolist():
            master.setdefault(i, torch.from_numpy(initial_rows(np.array([i], np.int64), 4, emb.init)[0]))
        rows = torch.stack([master[i] for i in ids.tolist()]).to(half).requires_grad_()
        (rows.float() ** 2).sum().backward()
        for k, i in enumerate(ids.tolist()):
            master[i] = master[i] - lr * rows.grad[k].float()
    with torch.no_grad():
        assert torch.equal(emb(torch.tensor(sorted(master))), torch.stack([master[i] for i in sorted(master)]).to(half))
