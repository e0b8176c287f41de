"""Worker script of bench/net/run.py: the CTR model of examples/ctr.py (a 16-wide PS embedding table over 26
ids, an MLP 429-256-128-1, Adam) on Criteo-format lines, timed after a warm-up, its loop pipelined as the
example's (`ctx.resumable`: each step's reply brings the next batch's rows). The epochs repeat until the
time is up. One JSON line to stdout, as bench/net/mlp_worker.py."""

import argparse
import json
import sys
import time
from pathlib import Path

import torch.nn.functional as F

import paramserver as ps
from paramserver.data import criteo

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from ctr import CTRModel  # the example's model, not a copy of it

EPOCHS = 1000  # more than any timed window needs: the loop stops on time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--table-rows", type=int, default=1_000_000)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()

    ctx = ps.init()
    model = CTRModel(table_rows=args.table_rows)
    opt = ps.optim.Adam(model.named_parameters(), lr=1e-3)
    lines = lambda epoch: criteo.batches(args.train, args.batch_size, ctx.worker_index, ctx.num_workers)
    steps, examples, started, pushed_before = -args.warmup_steps, 0, 0.0, 0
    for dense, sparse, labels in ctx.resumable(lines, epochs=EPOCHS):
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        loss.backward()
        opt.step()
        steps += 1
        if steps == 0:  # warm-up over: the clock starts
            started, pushed_before = time.perf_counter(), ctx.client.pushed_bytes
        elif steps > 0:
            examples += len(labels)
            if time.perf_counter() - started >= args.seconds:
                break
    elapsed = time.perf_counter() - started
    record = {
        "worker": ctx.worker_index,
        "steps": steps,
        "seconds": round(elapsed, 3),
        "examples_per_s": round(examples / elapsed, 1),
        "pushed_bytes_per_step": round((ctx.client.pushed_bytes - pushed_before) / max(steps, 1)),
        "loss": round(loss.item(), 4),
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
