"""`paramserver.serving.load`: a trained model served with no cluster, its predictions those of the
trained model bit for bit, and exportable with torch.export."""

import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver.checkpoint import tools
from paramserver.checkpoint.files import shard_file
from paramserver.checkpoint.store import CheckpointError, CheckpointStore, checkpoint_name
from paramserver.worker import current

VOCAB, DIM = 50, 4


class CTR(torch.nn.Module):
    """Dense features, a user id, and jagged categorical features in a collection."""

    def __init__(self):
        super().__init__()
        self.user = ps.nn.HashEmbedding(DIM, std=0.1)
        self.sparse = ps.nn.HashEmbeddingBagCollection([
            ps.nn.TableConfig("item", DIM, features=["clicked", "viewed"], mode="mean", std=0.1),
            ps.nn.TableConfig("site", 2, mode="max", std=0.1),
        ])
        torch.manual_seed(0)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(3 + 3 * DIM + 2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, dense, user, sparse):
        pooled = self.sparse(sparse)
        return self.mlp(torch.cat([dense, self.user(user), *pooled.values()], dim=1)).squeeze(1)


def batch(seed, size=8):
    g = torch.Generator().manual_seed(seed)
    sparse = {}
    for feature in ("clicked", "viewed", "site"):
        lengths = torch.randint(0, 4, (size,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        sparse[feature] = (torch.randint(0, VOCAB, (int(lengths.sum()),), generator=g), offsets)
    return (torch.randn(size, 3, generator=g), torch.randint(0, VOCAB, (size,), generator=g), sparse,
            torch.randn(size, generator=g))


def checkpoint(ctx, directory, step):
    """A checkpoint of the in-process cluster's shards, written as a PS node writes its file."""
    store, name = CheckpointStore(directory), checkpoint_name(step)
    entries = [shard_file.write(store, name, ch.service.shard, ch.service.shard.tables) for ch in ctx.client.channels]
    store.commit(name, {"step": step, "num_shards": len(entries), "shards": [e.__dict__ for e in entries]})


def trained(tmp_path):
    """Train a few steps on an in-process cluster; (predictions on held-out inputs while the cluster
    is up, those inputs, the file `paramserver checkpoint export` writes of the checkpoint taken
    then). The cluster is gone afterwards; the checkpoint is in tmp_path / "ckpt"."""
    ctx = ps.init(num_ps=2)
    model = CTR()
    opt = ps.optim.Adam(model.named_parameters(), lr=0.05)
    ps.Trainer(model, opt, F.mse_loss, verbose=False).fit([batch(s) for s in range(5)])
    opt.pull()
    model.eval()
    inputs = batch(99)[:3]
    with torch.no_grad():
        predictions = model(*inputs)
    checkpoint(ctx, str(tmp_path / "ckpt"), opt.steps)  # after the predictions: it holds the rows they created
    path = tools.export(str(tmp_path / "ckpt"), None, str(tmp_path / "model.safetensors"))
    ctx.shutdown()
    assert current.existing() is None
    return predictions, inputs, path


@pytest.mark.parametrize("source", ["export", "checkpoint"])
def test_a_served_model_predicts_as_the_trained_one_bit_for_bit_with_no_cluster(source, tmp_path, fresh_context):
    predictions, inputs, path = trained(tmp_path)
    model = CTR()
    info = ps.serving.load(model, path if source == "export" else str(tmp_path / "ckpt"))
    names = ["user", "sparse.tables.item", "sparse.tables.site"]
    # an export names tables by the module's path, as its dense names; a checkpoint by the PS's names
    assert info["tables"] == {n: n if source == "export" else f"opt0.{n}" for n in names}
    assert info["step"] == 5 and info["checkpoint"] == "ckpt-000000005"
    model.eval()
    with torch.no_grad():
        served = model(*inputs)
    assert torch.equal(served, predictions)
    assert current.existing() is None  # no paramserver.init() happened


def test_the_served_model_exports_with_torch_export_and_predicts_the_same(tmp_path, fresh_context):
    predictions, inputs, path = trained(tmp_path)
    model = CTR()
    ps.serving.load(model, path)
    model.eval()
    program = torch.export.export(model, inputs)
    program_path = tmp_path / "model.pt2"
    torch.export.save(program, program_path)
    with torch.no_grad():
        assert torch.equal(torch.export.load(program_path).module()(*inputs), predictions)


def test_an_id_the_table_does_not_hold_gets_a_zero_row(tmp_path, fresh_context):
    _, _, path = trained(tmp_path)
    model = CTR()
    ps.serving.load(model, path)
    rows = model.user(torch.tensor([3, 10**12, -5]))
    assert torch.equal(rows[1:], torch.zeros(2, DIM)) and rows[0].abs().sum() > 0
    bags = model.sparse({"clicked": torch.tensor([10**12]), "viewed": torch.tensor([7]), "site": torch.tensor([10**13])})
    assert torch.equal(bags["clicked"], torch.zeros(1, DIM)) and torch.equal(bags["site"], torch.zeros(1, 2))


def test_a_model_that_does_not_fit_the_file_is_refused_and_left_unchanged(tmp_path, fresh_context):
    _, _, path = trained(tmp_path)

    class Wider(CTR):
        def __init__(self):
            super().__init__()
            self.user = ps.nn.HashEmbedding(DIM + 1)

    model = Wider()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="table 'user' has dim 4, the model's 'user' 5"):
        ps.serving.load(model, path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.user.served is None

    class Extra(CTR):
        def __init__(self):
            super().__init__()
            self.other = ps.nn.HashEmbedding(DIM)

    with pytest.raises(CheckpointError, match="no table for the model's HashEmbedding 'other'"):
        ps.serving.load(Extra(), path)
    with pytest.raises(ps.InvalidArgumentError, match="name none"):
        ps.serving.load(CTR(), path, checkpoint="ckpt-000000001")


def test_an_export_names_tables_as_its_dense_names_the_modules_state_dict_keys(tmp_path, fresh_context):
    _, _, path = trained(tmp_path)
    saved = ps.load_export(path)
    keys = CTR().state_dict()
    assert set(saved["state_dict"]) == {k for k in keys if not k.endswith("placeholder")}
    assert sorted(saved["embeddings"]) == ["sparse.tables.item", "sparse.tables.site", "user"]
    assert all(f"{table}.placeholder" in keys for table in saved["embeddings"])


def test_table_names_lose_the_optimizer_prefix_unless_two_would_meet():
    names = tools.table_export_names(["opt0.user", "opt1.user", "opt0.item", "ctr.wide", "opt2.wide"])
    assert names == {"opt0.user": "opt0.user", "opt1.user": "opt1.user", "opt0.item": "item",
                     "ctr.wide": "ctr.wide", "opt2.wide": "wide"}
