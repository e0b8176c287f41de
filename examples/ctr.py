"""A DLRM-style click-through-rate model on Criteo-format data (add `--wide` for Wide&Deep).

13 dense features and 26 categorical features; every categorical id gets a 16-wide row in
one shared PS embedding table (no vocabulary: ids are hashed values); the dense features
and the 26 embeddings go through an MLP 256-128-1. With `--wide`, a linear part over the
same ids (a second, 1-wide table) is added. Worker 0 reports held-out AUC. Lines are parsed
by the C parser in a background thread, 4 batches ahead of the training loop (`--parse-ahead 0`
parses in the loop; `--prefetch N` in a loader process, N batches ahead). The loop is a plain
one: `ctx.resumable` pipelines it, so the next batch's rows (the batch after next's with
`--overlap`) come back with each step's reply (`--no-prefetch-rows`
looks them up at the forward instead; see docs/embeddings.md).

    python examples/ctr_data.py --rows 200000 --out /tmp/train.tsv --seed 1
    python examples/ctr_data.py --rows 20000 --out /tmp/test.tsv --seed 2
    paramserver run --ps 2 --workers 2 examples/ctr.py -- --train /tmp/train.tsv --test /tmp/test.tsv
"""

import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps
from paramserver.data import criteo, criteo_splits
from paramserver.evaluation import roc_auc


class CTRModel(nn.Module):
    def __init__(self, dim: int = 16, wide: bool = False, table_rows: int = 0) -> None:
        super().__init__()
        self.embedding = ps.nn.HashEmbedding(dim, std=0.01, name="ctr.embedding", capacity=table_rows)
        self.wide = ps.nn.HashEmbeddingBag(1, mode="sum", init="zeros", name="ctr.wide") if wide else None
        self.mlp = nn.Sequential(nn.Linear(criteo.NUM_DENSE + criteo.NUM_SPARSE * dim, 256), nn.ReLU(),
                                 nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        logit = self.mlp(torch.cat([dense, self.embedding(sparse).flatten(1)], dim=1))
        if self.wide is not None:
            logit = logit + self.wide(sparse)
        return logit.squeeze(1)


def evaluate(model: nn.Module, path: str, batch_size: int) -> float:
    model.eval()
    scores, labels = [], []
    with torch.no_grad():
        for dense, sparse, y in criteo.batches(path, batch_size):
            # Python floats, not one small tensor per batch: small live buffers between each batch's
            # large freed ones fragment the malloc heap (the worker's peak memory grew 15-30 MB)
            scores.extend(torch.sigmoid(model(dense, sparse)).tolist())
            labels.extend(y.tolist())
    model.train()
    return roc_auc(np.array(labels), np.array(scores))


def training_data(args, ctx):
    """The training data: this worker's share of the lines, or splits the coordinator hands out."""
    if not (args.splits or ctx.elastic):
        return lambda epoch: criteo.batches(args.train, args.batch_size, ctx.worker_index, ctx.num_workers,
                                            prefetch=args.prefetch, parse_ahead=args.parse_ahead)
    n = args.splits or 8 * ctx.num_workers

    def split(k, epoch, position=0):
        return criteo_splits.split_batches(args.train, args.batch_size, k, n, args.parse_ahead, position)

    return ps.Splits(n, split, split)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--test", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--overlap", action="store_true", help="overlap the dense push with the next batch")
    parser.add_argument("--prefetch", type=int, default=0,
                        help="batches parsed ahead in a loader process (default 0: no loader process)")
    parser.add_argument("--parse-ahead", type=int, default=criteo.PARSE_AHEAD,
                        help="batches parsed ahead in a background thread (0: parsed in the training loop)")
    parser.add_argument("--table-rows", type=int, default=1_000_000,
                        help="rows to reserve in the embedding table up front (it grows past them if needed)")
    parser.add_argument("--prefetch-rows", action=argparse.BooleanOptionalAction, default=True,
                        help="have each step bring the next batch's rows back with its reply (with --overlap, "
                             "the batch after next; default: on)")
    parser.add_argument("--wide", action="store_true", help="add a wide (linear) part: Wide&Deep")
    parser.add_argument("--splits", type=int, default=0,
                        help="hand the data out from the coordinator in this many byte-range splits (an elastic "
                             "run, --max-workers, always does: 8 per worker slot by default; docs/elastic.md)")
    args = parser.parse_args()

    ctx = ps.init()
    torch.manual_seed(0)
    model = CTRModel(wide=args.wide, table_rows=args.table_rows)
    opt = ps.optim.Adam(model.named_parameters(), lr=args.lr, overlap=args.overlap)
    started, examples = time.perf_counter(), 0
    # this worker's share, from its data position on (a restarted worker skips what it trained); each
    # step brings back the embedding rows of the batch its reply serves (docs/embeddings.md, "Pipelining")
    batches = ctx.resumable(training_data(args, ctx), epochs=args.epochs, prefetch_rows=args.prefetch_rows)
    for dense, sparse, labels in batches:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        loss.backward()
        opt.step()
        examples += len(labels)
        ctx.report(examples=len(labels), loss=loss.item())
    wall = time.perf_counter() - started
    ctx.barrier("trained")
    if ctx.is_chief:
        opt.pull()
        auc = evaluate(model, args.test, 512)
        print(f"held-out AUC {auc:.4f}", flush=True)
        ps.log_scalar("test/auc", auc)  # TensorBoard, with --logdir (the loss goes there through ctx.report)
        ctx.report_result(test_auc=round(auc, 4), worker0_examples_per_s=round(examples / wall, 1))


if __name__ == "__main__":
    main()
