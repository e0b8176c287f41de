"""A small training that says where it runs and where it starts: each worker trains `--batches`
batches (one Linear layer, SGD), sleeping `--step-sleep` seconds after each step, from its data
position on (a resumed run goes on from the checkpoint's). Prints, per worker:

    worker I on HOST starts at position P
    worker I on HOST trained to position Q

With `--record DIR`, each worker also appends to DIR/worker-I.txt a line "start P" when it starts, then the
index of each batch it trained, as the batch says it (the test counts which batches a requeued job lost or
repeated).
"""

import argparse
import socket
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--batches", type=int, default=200)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--record", default="")
args = parser.parse_args()

ctx = ps.init()
host = socket.gethostname()
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = ps.optim.SGD(model.named_parameters(), lr=0.01)


def batches(epoch):
    for k in range(args.batches):
        g = torch.Generator().manual_seed(k)
        yield torch.randn(8, 4, generator=g), torch.randn(8, generator=g), torch.tensor([k])


print(f"worker {ctx.worker_index} on {host} starts at position {ctx.resume_step}", flush=True)
record = open(f"{args.record}/worker-{ctx.worker_index}.txt", "a", buffering=1) if args.record else None
if record:
    record.write(f"start {ctx.resume_step}\n")
position = ctx.resume_step
for x, y, k in ctx.resumable(batches, steps_per_epoch=args.batches):
    opt.zero_grad()
    F.mse_loss(model(x).squeeze(1), y).backward()
    if record:  # before the step: after a preemption's checkpoint, its step ends the script (Preempted)
        record.write(f"{int(k)}\n")
    opt.step()
    position += 1
    if position % 20 == 0:
        print(f"worker {ctx.worker_index} on {host} at position {position}", flush=True)
    if args.step_sleep:
        time.sleep(args.step_sleep)
print(f"worker {ctx.worker_index} on {host} trained to position {position}", flush=True)
