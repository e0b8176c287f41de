"""`paramserver.optim`: swap `torch.optim.X` for `paramserver.optim.X`; the math then runs on the PS."""

from paramserver.optim.ps_optimizers import SGD, Adagrad, Adam, AdamW, PSOptimizer

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "PSOptimizer"]
