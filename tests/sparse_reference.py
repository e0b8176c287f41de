"""A table's reference in torch: nn.Embedding(sparse=True) with a HashEmbedding's initial rows, the optimizer
cases compared, and the batches both train on."""

import numpy as np
import torch

from paramserver.tables.embedding_table import initial_rows

VOCAB, DIM = 30, 4


# (paramserver optimizer, torch's sparse optimizer for the table, arguments)
CASES = [
    ("Adam", torch.optim.SparseAdam, {}),
    ("Adam", torch.optim.SparseAdam, {"lr": 0.01}),
    ("Adam", torch.optim.SparseAdam, {"lr": torch.tensor(0.001)}),
    ("Adam", torch.optim.SparseAdam, {"maximize": True}),
    ("Adam", torch.optim.SparseAdam, {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}),
    ("Adagrad", torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.5}),
    ("Adagrad", torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1, "maximize": True}),
    ("SGD", torch.optim.SGD, {"lr": 0.1, "maximize": True}),
]


def table_batches(steps: int, ids_per_step: int):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (ids_per_step,), generator=g), torch.randn(ids_per_step, DIM, generator=g))
            for _ in range(steps)]


def reference_table() -> torch.nn.Embedding:
    table = torch.nn.Embedding(VOCAB, DIM, sparse=True)
    with torch.no_grad():
        table.weight.copy_(torch.from_numpy(initial_rows(np.arange(VOCAB, dtype=np.int64), DIM,
                                                         {"kind": "normal", "std": 0.1})))
    return table
