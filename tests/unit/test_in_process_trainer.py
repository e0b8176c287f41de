"""`paramserver.init()` with no cluster, the PS shards in this process: the Trainer's epochs, metrics and
scheduler, and pulled values on each parameter's own device. The example scripts run as plain Python scripts
in tests/integration/test_in_process.py."""

import pytest
import torch
import torch.nn.functional as F
from tests.reference import mlp
from torch.utils.data import DataLoader, TensorDataset

import paramserver as ps


def test_trainer_fit_reports_per_epoch_metrics_and_learns(fresh_context):
    ctx = ps.init(num_ps=2)
    assert (ctx.in_process, ctx.worker_index, ctx.num_workers, ctx.num_ps) == (True, 0, 1, 2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 784, generator=g)
    y = (x[:, 0] > 0).long()  # a learnable rule
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    model = mlp(sizes=(784, 32, 2))
    trainer = ps.Trainer(model, ps.optim.Adam(model.parameters(), lr=1e-2), F.cross_entropy, verbose=False)
    history = trainer.fit(loader, epochs=3, steps_per_epoch=5)
    assert [h.epoch for h in history] == [1, 2, 3]
    assert all(h.steps == 5 and h.examples == 160 and h.examples_per_s > 0 for h in history)
    assert history[-1].loss < history[0].loss
    assert trainer.evaluate(loader)["accuracy"] > 0.8


def test_trainer_steps_a_scheduler_after_each_epoch_and_the_ps_uses_its_rate(fresh_context):
    ps.init(num_ps=1)
    torch.manual_seed(0)
    reference = mlp(sizes=(784, 8, 2))
    model = mlp(sizes=(784, 8, 2))
    model.load_state_dict(reference.state_dict())
    x = torch.randn(64, 784, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)
    opt = ps.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ps.Trainer(model, opt, F.cross_entropy, verbose=False).fit(loader, epochs=3, scheduler=schedule)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    schedule_ref = torch.optim.lr_scheduler.StepLR(opt_ref, step_size=1, gamma=0.5)
    for _ in range(3):
        for xb, yb in loader:
            opt_ref.zero_grad()
            F.cross_entropy(reference(xb), yb).backward()
            opt_ref.step()
        schedule_ref.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0125)
    opt.pull()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_pulled_values_land_on_each_parameters_own_device(fresh_context):
    ps.init(num_ps=2)
    reference = mlp(sizes=(784, 32, 10))
    model = mlp(sizes=(784, 32, 10)).cuda()
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-3)
    opt = ps.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 784), torch.randint(0, 10, (16,))
    for m, o, xx, yy in ((reference, opt_ref, x, y), (model, opt, x.cuda(), y.cuda())):
        for _ in range(5):
            o.zero_grad()
            F.cross_entropy(m(xx), yy).backward()
            o.step()
    assert all(p.device.type == "cuda" for p in model.parameters())
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)
