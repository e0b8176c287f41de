"""A CTR model on Criteo-format data with a table per categorical feature, jagged features and Trainer.

The 26 categorical features go to 26 PS tables held by one `HashEmbeddingBagCollection`; each
feature reaches it as jagged ids, `(values, offsets)`, with a missing value (an empty field)
making an empty bag, which pools to zeros. The 13 dense features and the 26 pooled embeddings go
through an MLP 256-128-1. `ps.Trainer` trains it from batches `({"dense": ..., "sparse": ...},
labels)` (it calls `model(dense=..., sparse=...)`); its pipelining brings every table's rows of
the next batch back with each step, so a step is one request per PS. Worker 0 reports held-out
AUC. With `--checkpoint-dir`, `paramserver checkpoint export` and `ps.serving.load(CTRModel(), path)`
serve the trained model with no cluster (docs/embeddings.md, "Serving what was trained").

    python examples/ctr_data.py --rows 200000 --out /tmp/train.tsv --seed 1
    python examples/ctr_data.py --rows 20000 --out /tmp/test.tsv --seed 2
    paramserver run --ps 2 --workers 2 examples/ctr_jagged.py -- --train /tmp/train.tsv --test /tmp/test.tsv
"""

import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps
from paramserver.data import criteo
from paramserver.evaluation import roc_auc

FEATURES = [f"C{k}" for k in range(1, criteo.NUM_SPARSE + 1)]
# the id each feature's empty field gets: a missing value, left out of its (then empty) bag
EMPTY = torch.from_numpy(criteo.parse_lines(["0" + "\t" * (criteo.NUM_FIELDS - 1)])[1][0])


def jagged(sparse: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(batch, 26) ids -> {feature: (values, offsets)}: each example's bag of 0 or 1 id."""
    present = sparse != EMPTY
    features = {}
    for k, name in enumerate(FEATURES):
        kept = present[:, k]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), kept.cumsum(0)[:-1]])
        features[name] = (sparse[kept, k], offsets)
    return features


def batches(path: str, batch_size: int, skip: int = 0, every: int = 1):
    for dense, sparse, labels in criteo.batches(path, batch_size, skip, every):
        yield {"dense": dense, "sparse": jagged(sparse)}, labels


class CTRModel(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.sparse = ps.nn.HashEmbeddingBagCollection([ps.nn.TableConfig(name, dim) for name in FEATURES])
        self.mlp = nn.Sequential(nn.Linear(criteo.NUM_DENSE + len(FEATURES) * dim, 256), nn.ReLU(),
                                 nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, dense: torch.Tensor, sparse: dict) -> torch.Tensor:
        pooled = self.sparse(sparse)
        return self.mlp(torch.cat([dense, *pooled.values()], dim=1)).squeeze(1)


def evaluate(model: nn.Module, path: str) -> float:
    model.eval()
    scores, labels = [], []
    with torch.no_grad():
        for x, y in batches(path, 512):
            scores.extend(torch.sigmoid(model(**x)).tolist())
            labels.extend(y.tolist())
    model.train()
    return roc_auc(np.array(labels), np.array(scores))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--test", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    ctx = ps.init()
    torch.manual_seed(0)
    model = CTRModel()
    opt = ps.optim.Adam(model.named_parameters(), lr=args.lr)
    trainer = ps.Trainer(model, opt, F.binary_cross_entropy_with_logits, verbose=ctx.is_chief)
    trainer.fit(lambda epoch: batches(args.train, args.batch_size, ctx.worker_index, ctx.num_workers),
                epochs=args.epochs)
    ctx.barrier("trained")
    if ctx.is_chief:
        opt.pull()
        auc = evaluate(model, args.test)
        print(f"held-out AUC {auc:.4f}", flush=True)
        ctx.report_result(test_auc=round(auc, 4))


if __name__ == "__main__":
    main()
