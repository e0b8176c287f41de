"""examples/ctr.py's training loop as it was written by hand before the library pipelined it.

The same model, data and optimizer as examples/ctr.py; the loop keeps its own window of batches
and calls `prefetch` on each table with the batch the next reply serves. bench/pipeline.py sets
it beside the plain loop of examples/ctr.py. Run under `paramserver run`, like examples/ctr.py.
"""

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver.data import criteo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from ctr import CTRModel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--test", required=True)  # unused: the same command line as examples/ctr.py
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--overlap", action="store_true")
    args = parser.parse_args()
    ctx = ps.init()
    torch.manual_seed(0)
    model = CTRModel(table_rows=1_000_000)
    opt = ps.optim.Adam(model.named_parameters(), lr=1e-3, overlap=args.overlap)
    started, examples = time.perf_counter(), 0
    batches = iter(ctx.resumable(lambda epoch: criteo.batches(args.train, args.batch_size, ctx.worker_index,
                                                              ctx.num_workers), prefetch_rows=False))
    ahead = 2 if args.overlap else 1
    window = list(itertools.islice(batches, ahead))
    while window:
        dense, sparse, labels = window.pop(0)
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        window.extend(itertools.islice(batches, ahead - len(window)))
        if len(window) == ahead:
            model.embedding.prefetch(window[-1][1])
        loss.backward()
        opt.step()
        examples += len(labels)
        ctx.report(examples=len(labels), loss=loss.item())
    ctx.barrier("trained")
    if ctx.is_chief:
        ctx.report_result(test_auc=0.0, worker0_examples_per_s=round(examples / (time.perf_counter() - started), 1))


if __name__ == "__main__":
    main()
