"""The seed article's model on real handwritten digits, trained on a parameter-server cluster.

Dense 1024-relu, 512-relu, 10 (softmax in the loss), Adam with a cosine learning-rate schedule
over the epochs (the final model then does not depend on where the last steps happened to
land), cross-entropy; scikit-learn's
bundled 8x8 digits upscaled to 28x28 so the input is the article's 784 pixels. Each worker
trains on its own shard of the training set; worker 0 then reports held-out accuracy.

    paramserver run --ps 2 --workers 2 examples/digits.py -- --epochs 20
    paramserver run --ps 2 --workers 2 --logdir runs/digits examples/digits.py   # + TensorBoard
    python examples/digits.py          # same script, in-process cluster
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

import paramserver as ps


def digits_784() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as 784-pixel images scaled to [0, 1], with their labels."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    return images.flatten(1), torch.tensor(digits.target)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    ctx = ps.init()
    x, y = digits_784()
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    shard = slice(ctx.worker_index, None, ctx.num_workers)  # this worker's share of the training set
    train = DataLoader(TensorDataset(x_train[shard], y_train[shard]), batch_size=args.batch_size, shuffle=True,
                       generator=torch.Generator().manual_seed(ctx.worker_index))
    test = DataLoader(TensorDataset(x_test, y_test), batch_size=256)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = ps.optim.Adam(model.named_parameters(), lr=args.lr)
    trainer = ps.Trainer(model, opt, F.cross_entropy)
    started = time.perf_counter()
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    history = trainer.fit(train, epochs=args.epochs, scheduler=schedule)
    ctx.barrier("trained")  # evaluate the final model, after every worker's last push
    if ctx.is_chief:
        metrics = trainer.evaluate(test)
        print(f"test accuracy {metrics['accuracy']:.4f} on {metrics['examples']} held-out digits", flush=True)
        ps.log_scalar("test/accuracy", metrics["accuracy"])  # TensorBoard, with --logdir
        ctx.report_result(test_accuracy=round(metrics["accuracy"], 4),
                          worker0_examples_per_s=round(sum(h.examples for h in history)
                                                       / (time.perf_counter() - started), 1))


if __name__ == "__main__":
    main()
