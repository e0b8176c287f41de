"""`paramserver checkpoint export --since CKPT`: a whole export of CKPT with the delta applied holds,
id by id and bit for bit, the rows of a whole export of the later checkpoint (evicted rows stay
deleted), whether CKPT is a link of the later checkpoint's chain, in an older chain, or both are
whole checkpoints; a served model updated in place predicts as one loaded from the later export;
a CKPT that is not an earlier checkpoint of the directory is a clear error (exit 2)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tests.unit.test_incremental_checkpoints import Cluster
from tests.unit.test_serving import CTR, batch, checkpoint

import paramserver as ps
from paramserver.checkpoint import tools
from paramserver.checkpoint.export import delta_export
from paramserver.checkpoint.store import CheckpointError, checkpoint_name
from paramserver.launch import cli

BASES = (1, 5)  # steps whose chain checkpoint is a base (whole); the others are deltas on the one before


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Checkpoints 1..7 of 2 shards with eviction, each written as a chain link and as a whole file."""
    tmp_path = tmp_path_factory.mktemp("run")
    cluster = Cluster(tmp_path, num_ps=2, policy={"max_rows": 40, "evict_every": 2})
    for step in range(1, 8):
        cluster.train(2, batch=20)  # about half the rows touched each time; from step 3 on, some evicted
        cluster.checkpoint(step, delta=step not in BASES)
    return cluster


def rows_by_id(saved):
    """{table: (ids sorted, weight rows in that order)} of a load_export dict."""
    out = {}
    for table, got in saved["embeddings"].items():
        order = torch.argsort(got["ids"])
        out[table] = (got["ids"][order].numpy(), got["weight"][order].numpy())
    return out


def assert_same_rows(applied, expected):
    got, want = rows_by_id(applied), rows_by_id(expected)
    assert got.keys() == want.keys()
    for table in want:
        assert np.array_equal(got[table][0], want[table][0]), table
        assert got[table][1].tobytes() == want[table][1].tobytes(), table  # bit for bit
    assert applied["checkpoint"] == expected["checkpoint"] and applied["step"] == expected["step"]


@pytest.mark.parametrize("store", ["chain", "whole"])
@pytest.mark.parametrize(
    "since,later",
    [(2, 4), (1, 4), (4, 5), (3, 7), (6, 7)],
    ids=["in-chain", "from-base", "onto-new-base", "across-chains", "last-link"],
)
def test_a_whole_export_with_the_delta_applied_is_the_later_export(run, store, since, later, tmp_path, monkeypatch):
    monkeypatch.setattr(delta_export, "PARTITION_BYTES", 512)  # rows compared: 4 partitions
    url = (run.chain if store == "chain" else run.whole).url
    old, new = checkpoint_name(since), checkpoint_name(later)
    base = ps.load_export(tools.export(url, old, str(tmp_path / "old.safetensors")))
    full = ps.load_export(tools.export(url, new, str(tmp_path / "new.safetensors")))
    path = delta_export.export_delta(url, new, old, str(tmp_path / "delta.safetensors"))
    delta = delta_export.load_delta(path)
    assert (delta["since"], delta["checkpoint"], delta["step"]) == (old, new, later)
    assert_same_rows(delta_export.apply_to_export(base, delta), full)
    changes = delta["embeddings"]["t"]
    gone = set(base["embeddings"]["t"]["ids"].tolist()) - set(full["embeddings"]["t"]["ids"].tolist())
    assert gone and gone <= set(changes["deleted"].tolist())  # evicted rows named, so they stay deleted
    assert not set(changes["deleted"].tolist()) & set(full["embeddings"]["t"]["ids"].tolist())
    if store == "whole":  # rows compared: each one exported is new, or holds other bits than before
        before = dict(zip(*rows_by_id(base)["t"]))
        for row_id, row in zip(changes["ids"].tolist(), changes["weight"].numpy()):
            assert row_id not in before or before[row_id].tobytes() != row.tobytes()


def test_on_a_chain_only_the_rows_written_since_are_exported(run, tmp_path):
    url = run.chain.url
    delta = delta_export.load_delta(
        delta_export.export_delta(url, checkpoint_name(3), checkpoint_name(2), str(tmp_path / "d.safetensors"))
    )
    with (
        safe_open(str(run.chain.path(checkpoint_name(3), "shard-0.safetensors")), "np") as f0,
        safe_open(str(run.chain.path(checkpoint_name(3), "shard-1.safetensors")), "np") as f1,
    ):
        written = set(f0.get_tensor("table/t/ids").tolist()) | set(f1.get_tensor("table/t/ids").tolist())
    assert set(delta["embeddings"]["t"]["ids"].tolist()) == written


@pytest.mark.parametrize(
    "since,problem",
    [
        (checkpoint_name(4), "is not earlier than ckpt-000000004"),
        (checkpoint_name(6), "is not earlier than ckpt-000000004"),
        (checkpoint_name(99), "is not earlier than"),
        ("ckpt-000000000", "is not a complete checkpoint in"),
        ("../elsewhere", "is not a checkpoint name"),
    ],
)
def test_a_since_that_is_not_an_earlier_checkpoint_of_the_directory_is_an_error(run, since, problem, tmp_path, capsys):
    out = str(tmp_path / "d.safetensors")
    with pytest.raises(CheckpointError, match=problem):
        delta_export.export_delta(run.chain.url, checkpoint_name(4), since, out)
    assert cli.main(["checkpoint", "export", run.chain.url, checkpoint_name(4), "--since", since, "--out", out]) == 2
    assert problem in capsys.readouterr().err
    assert cli.main(["checkpoint", "list", run.chain.url, "--since", checkpoint_name(1)]) == 2
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_the_cli_writes_the_delta_and_prints_its_path(run, tmp_path, capsys):
    out = str(tmp_path / "d.safetensors")
    assert cli.main(["checkpoint", "export", run.chain.url, "--since", checkpoint_name(5), "--out", out]) == 0
    assert capsys.readouterr().out.strip() == out
    assert delta_export.load_delta(out)["checkpoint"] == checkpoint_name(7)  # the newest by default
    assert [p.name for p in tmp_path.iterdir()] == ["d.safetensors"]  # the spool files are gone


def test_a_served_model_updated_in_place_serves_the_later_checkpoint_bit_for_bit(tmp_path, fresh_context):
    ctx = ps.init(num_ps=2)
    model = CTR()
    opt = ps.optim.Adam(model.named_parameters(), lr=0.05)
    trainer = ps.Trainer(model, opt, F.mse_loss, verbose=False)
    url = str(tmp_path / "ckpt")
    trainer.fit([batch(s) for s in range(3)])
    checkpoint(ctx, url, 3)
    trainer.fit([batch(s) for s in range(10, 14)])  # new ids and changed rows
    checkpoint(ctx, url, 7)
    ctx.shutdown()
    old, new = checkpoint_name(3), checkpoint_name(7)
    served, expected = CTR(), CTR()
    ps.serving.load(served, tools.export(url, old, str(tmp_path / "old.safetensors")))
    ps.serving.load(expected, tools.export(url, new, str(tmp_path / "new.safetensors")))
    delta = delta_export.export_delta(url, new, old, str(tmp_path / "delta.safetensors"))
    info = ps.serving.apply_delta(served, delta)
    assert info["checkpoint"] == new and info["since"] == old and info["tables"]["user"]["rows"] > 0
    got, want = served.state_dict(), expected.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    inputs = batch(99)[:3]
    served.eval(), expected.eval()
    with torch.no_grad():
        assert torch.equal(served(*inputs), expected(*inputs))
    from_checkpoint = CTR()  # a model loaded from the checkpoint itself takes the same delta
    ps.serving.load(from_checkpoint, url, checkpoint=old)
    ps.serving.apply_delta(from_checkpoint, delta)
    assert all(torch.equal(from_checkpoint.state_dict()[key], want[key]) for key in want)
    before = {k: v.clone() for k, v in served.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=rf"is a delta since {old} \(sha256 \w+, run .*\); the model serves {new} "
    ):
        ps.serving.apply_delta(served, delta)  # once only: the model serves the later checkpoint now
    assert all(torch.equal(before[k], v) for k, v in served.state_dict().items())
