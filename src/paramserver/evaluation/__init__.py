"""`paramserver.evaluation`: follow a run's checkpoints on an evaluator task, and held-out metrics.

if ctx.is_evaluator: ctx.evaluate(model, fn)   # or paramserver.evaluate(model, fn)
auc = paramserver.evaluation.roc_auc(labels, scores)
"""

from paramserver.evaluation.evaluator import Evaluation, evaluate
from paramserver.evaluation.metrics import log_loss, roc_auc

__all__ = ["Evaluation", "evaluate", "log_loss", "roc_auc"]
