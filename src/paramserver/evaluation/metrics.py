"""Held-out metrics computed with numpy alone (no scikit-learn or scipy in a worker's memory)."""

from __future__ import annotations

import numpy as np


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve of binary `labels` ranked by `scores` (ties share their mean rank)."""
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, np.float64).ravel()
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        raise ValueError("AUC needs both positive and negative labels")
    unique, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    upper = np.cumsum(counts)
    mean_rank = upper - (counts - 1) / 2.0  # 1-based mean rank of each distinct score
    rank_sum = mean_rank[inverse][labels].sum()
    return float((rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives))


def log_loss(labels: np.ndarray, probabilities: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of binary `labels` against predicted `probabilities` of the positive
    class, each clipped to [eps, 1 - eps] (a confident wrong prediction costs -log(eps), not infinity)."""
    labels = np.asarray(labels, np.float64).ravel()
    p = np.clip(np.asarray(probabilities, np.float64).ravel(), eps, 1.0 - eps)
    if labels.size != p.size:
        raise ValueError(f"log loss needs one probability per label, got {p.size} for {labels.size}")
    if labels.size == 0:
        raise ValueError("log loss needs at least one example")
    return float(-np.mean(labels * np.log(p) + (1.0 - labels) * np.log1p(-p)))
