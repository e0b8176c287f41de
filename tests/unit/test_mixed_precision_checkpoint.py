"""Checkpoints of bfloat16 variables hold the float32 masters (the format is unchanged); a bfloat16
model loads them rounded, and a PS restoring them serves them in whichever wire dtype registers."""

import numpy as np
import torch
import torch.nn as nn

import paramserver as ps
from paramserver.checkpoint.files import shard_file
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointStore, checkpoint_name
from paramserver.server.shard import Push, Shard
from paramserver.serving.checkpoint_model import load_into
from paramserver.tables.table_store import TableStore
from paramserver.wire.half import float32_to_bf16_bits

SGD = {"name": "sgd", "hyper": {"lr": 0.1}}
NAMES = ("opt0.weight", "opt0.bias")


def trained_shard() -> Shard:
    """A bfloat16 Linear(2, 3) after one step whose float32 masters no bfloat16 holds."""
    model = nn.Linear(2, 3).to(torch.bfloat16)
    shard = Shard(0)
    initial = {name: p.detach().float().numpy() for name, p in zip(NAMES, model.parameters())}
    shard.register("opt0.group0", SGD, initial, wire=dict.fromkeys(NAMES, "bfloat16"))
    grads = {NAMES[0]: np.full((3, 2), 0.0123, np.float32), NAMES[1]: np.full(3, -0.0456, np.float32)}
    shard.push(Push({name: float32_to_bf16_bits(grad) for name, grad in grads.items()}))
    return shard


def masters(shard: Shard) -> dict[str, np.ndarray]:
    return shard.snapshot(lambda groups, *_: {n: groups["opt0.group0"].view(n).copy() for n in NAMES})


def saved(tmp_path, shard: Shard) -> RestoreSource:
    store, name = CheckpointStore(str(tmp_path)), checkpoint_name(1)
    store.commit(name, {"step": 1, "num_shards": 1,
                        "shards": [shard_file.write(store, name, shard, TableStore(0)).__dict__]})
    return RestoreSource(store, name)


def test_the_checkpoint_holds_the_float32_masters_and_a_bfloat16_model_loads_them_rounded(tmp_path):
    shard = trained_shard()
    source = saved(tmp_path, shard)
    expected = masters(shard)
    assert any(not np.array_equal(float32_to_bf16_bits(v).astype(np.uint32) << 16, v.view(np.uint32))
               for v in expected.values())  # the masters hold bits a bfloat16 drops
    for name in NAMES:
        value = source.dense_variables()["opt0.group0"]["vars"][name].value
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, expected[name])
    model = nn.Linear(2, 3).to(torch.bfloat16)
    load_into(model, source)
    assert model.weight.dtype == torch.bfloat16
    for name, param in zip(NAMES, model.parameters()):
        np.testing.assert_array_equal(param.detach().view(torch.int16).numpy().view(np.uint16),
                                      float32_to_bf16_bits(expected[name]))
    plain = nn.Linear(2, 3)  # the same checkpoint into a float32 model: the masters themselves
    load_into(plain, source)
    np.testing.assert_array_equal(plain.weight.detach().numpy(), expected[NAMES[0]])


def test_a_restored_shard_serves_the_masters_in_the_registered_wire_dtype(tmp_path):
    shard = trained_shard()
    source, expected = saved(tmp_path, shard), masters(shard)
    for wire in ("bfloat16", "float32"):
        restored = Shard(0, restore=source)
        model = nn.Linear(2, 3)
        initial = {name: p.detach().numpy() for name, p in zip(NAMES, model.parameters())}
        restored.register("opt0.group0", SGD, initial, wire=dict.fromkeys(NAMES, wire) if wire != "float32" else {})
        values = restored.pull(NAMES, lambda version, views: {n: v.copy() for n, v in views})
        for name in NAMES:
            want = float32_to_bf16_bits(expected[name]) if wire == "bfloat16" else expected[name]
            np.testing.assert_array_equal(values[name], want)


def test_a_bfloat16_hash_embedding_loads_its_tables_saved_float32_rows_rounded(tmp_path):
    tables = TableStore(0)
    tables.register("opt0.emb", 2, SGD, {"kind": "normal", "std": 0.5}, wire="bfloat16")
    saved_rows = np.array([[0.1, -0.2], [0.3, 0.4]], np.float32)  # no bfloat16 holds these
    tables.table("opt0.emb").load_rows(np.array([3, 10], np.int64), {"values": saved_rows})
    store, name = CheckpointStore(str(tmp_path)), checkpoint_name(1)
    shard = Shard(0)
    shard.register("opt0.group0", SGD, {"opt0.fc.weight": np.ones((1, 2), np.float32)})
    store.commit(name, {"step": 1, "num_shards": 1, "shards": [shard_file.write(store, name, shard, tables).__dict__]})

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = ps.nn.HashEmbedding(2, dtype=torch.bfloat16)
            self.fc = nn.Linear(2, 1, bias=False).to(torch.bfloat16)

    model = Model()
    load_into(model, RestoreSource(store, name))
    with torch.no_grad():
        rows = model.emb(torch.tensor([3, 10]))
    assert rows.dtype == torch.bfloat16
    assert torch.equal(rows, torch.from_numpy(saved_rows).to(torch.bfloat16))
