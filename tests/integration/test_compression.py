"""Gradient compression over a real PS process: the numbers, the loss reached, the bytes pushed."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tests.conftest import ROOT
from tests.reference import mlp, twin

import paramserver as ps
from paramserver.base.config import ClusterSpec, NodeConfig, Options, Task

pytestmark = pytest.mark.cluster  # a real PS process per test

CODECS = ["none", "fp16", "bf16", "int8", "topk:0.01"]
STEPS = 300


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Small models on a busy machine: one thread per op is faster, and the numbers are the same."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def join(address, compression, **options):
    cluster = ClusterSpec(ps=(address,), worker=("127.0.0.1:0",))
    return ps.init(NodeConfig(cluster, Task("worker", 0), Options(connect_timeout_s=20, compression=compression,
                                                                  **options)))


def learnable(steps, batch=32, features=784, seed=1):
    """Batches labelled by a fixed random linear teacher: a loss that training can bring down."""
    teacher = torch.randn(features, 10, generator=torch.Generator().manual_seed(0))  # one teacher for all data
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(batch, features, generator=g) for _ in range(steps)]
    return [(x, (x @ teacher).argmax(1)) for x in xs]


def fit(model, opt, data, cast=None):
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if cast is not None:  # the reference's compression: each gradient cast and back
            for p in model.parameters():
                p.grad = p.grad.to(cast).float()
        opt.step()


def test_fp16_gradients_train_exactly_as_torch_with_gradients_cast_to_fp16(procs, fresh_context):
    join(procs.start_ps()[1], "fp16", split_bytes=4096)  # split variables: each part cast alike
    reference = mlp()
    model = twin(reference)
    data = learnable(30)
    # lr a power of two: lr * g is exact, so the PS's and torch's updates round once, alike, and any
    # difference would be the gradients'
    fit(reference, torch.optim.SGD(reference.parameters(), lr=0.0625), data, cast=torch.float16)
    fit(model, ps.optim.SGD(model.named_parameters(), lr=0.0625), data)
    for got, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_rule_compresses_only_the_parameters_it_names(procs, fresh_context):
    ctx = join(procs.start_ps()[1], "0.*=int8")
    model = mlp()
    ps.optim.SGD(model.named_parameters(), lr=0.05)
    assert sorted(ctx.client.compressor.codecs) == ["opt0.0.bias", "opt0.0.weight"]
    assert sorted(ctx.client.compressor.residuals) == ["opt0.0.bias", "opt0.0.weight"]


def train_with(procs, compression):
    """Final held-out loss and bytes per step of a short run with `compression`, on a PS of its own."""
    ctx = join(procs.start_ps()[1], compression)
    model = mlp(sizes=(64, 64, 10))
    data = learnable(STEPS, features=64)
    held_out = learnable(1, batch=512, features=64, seed=2)[0]
    fit(model, ps.optim.Adam(model.named_parameters(), lr=3e-3), data)
    with torch.no_grad():
        loss = F.cross_entropy(model(held_out[0]), held_out[1]).item()
    figures = {"loss": loss, "gradient_bytes": ctx.client.gradient_bytes / STEPS,
               "pushed_bytes": ctx.client.pushed_bytes / STEPS}
    ctx.shutdown()
    return figures


def test_each_codec_reaches_a_loss_close_to_uncompressed_with_fewer_bytes(procs, fresh_context):
    runs = {codec: train_with(procs, "" if codec == "none" else codec) for codec in CODECS}
    plain = runs["none"]
    start = torch.log(torch.tensor(10.0)).item()  # the untrained loss, about: training must have moved it
    assert plain["loss"] < 0.5 * start
    for codec in ("fp16", "bf16", "int8"):  # close to the uncompressed run
        assert runs[codec]["loss"] < 1.03 * plain["loss"], (codec, runs)
    # 1% of the values a step: error feedback still carries the rest, later; at least half the way
    assert runs["topk:0.01"]["loss"] < start - 0.5 * (start - plain["loss"]), runs
    ratio = {codec: plain["gradient_bytes"] / run["gradient_bytes"] for codec, run in runs.items()}
    assert ratio["fp16"] == ratio["bf16"] == 2.0
    assert 3.9 < ratio["int8"] <= 4.0  # one byte a value, plus a float32 scale per 1024 values
    assert ratio["topk:0.01"] > 40  # 1% of the values (at least one per variable), 8 bytes each
    frames = {codec: plain["pushed_bytes"] / run["pushed_bytes"] for codec, run in runs.items()}
    assert 1.9 < frames["fp16"] and 3.3 < frames["int8"] and 10 < frames["topk:0.01"], frames  # headers too


@pytest.mark.parametrize("compression", ["int8", "bf16"])
def test_table_rows_are_compressed_and_topk_leaves_them_as_they_are(procs, fresh_context, compression):
    ctx = join(procs.start_ps()[1], f"*=topk:0.5,*={compression}")  # a table skips the topk rule
    embedding = ps.nn.HashEmbedding(8, name="emb", init="zeros")
    opt = ps.optim.SGD(embedding.parameters(), lr=1.0)
    ids = torch.tensor([3, 5, 7])
    opt.zero_grad()
    embedding(ids).sum().backward()
    opt.step()
    assert ctx.tables.codecs["emb"].kind == compression
    rows = ctx.tables.lookup("emb", ids.numpy())
    assert (rows == -1.0).all()  # a gradient of ones survives int8 and bf16 exactly
    assert ctx.client.gradient_bytes == (3 * 8 + 3 * 4 if compression == "int8" else 3 * 8 * 2)


def run_small(procs, *options):
    """`paramserver run` of the launcher tests' small job (1 PS, 2 workers in sync mode): its closing JSON line."""
    script = str(ROOT / "tests" / "integration" / "scripts" / "train_small.py")
    proc = procs.start([sys.executable, "-m", "paramserver", "--log-level", "WARNING", "run", "--ps", "1",
                        "--workers", "2", "--mode", "sync", "--progress-every", "0", *options, script, "--",
                        "--steps", "20"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def test_paramserver_run_compression_flag_reaches_the_workers_and_its_bytes_the_summary(procs):
    plain, compressed = run_small(procs), run_small(procs, "--compression", "fp16")
    assert plain["steps"] == compressed["steps"] == 40
    assert abs(plain["pushed_bytes"] - 40 * plain["pushed_bytes_per_step"]) <= 20 and plain["pushed_bytes"] > 0
    # 370 float32 values a step: fp16 saves 740 bytes of each frame, its encodings in the header cost some back
    assert 400 < plain["pushed_bytes_per_step"] - compressed["pushed_bytes_per_step"] < 740
