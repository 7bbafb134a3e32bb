"""Evaluation metrics computed on the device that holds the scores."""

from __future__ import annotations

import torch


def roc_auc(labels: torch.Tensor, scores: torch.Tensor) -> float:
    """Area under the ROC curve, tied scores handled as sklearn's ``roc_auc_score`` does.

    Sort once, keep the last index of every run of equal scores as a threshold, count true and
    false positives there, and integrate with the trapezoid rule (ties become diagonal segments).
    Returns NaN when only one class is present (the AUC is undefined then).
    """
    labels = labels.reshape(-1).to(torch.float64)
    scores = scores.reshape(-1).to(torch.float64)
    if labels.numel() != scores.numel():
        raise ValueError(f"labels ({labels.numel()}) and scores ({scores.numel()}) differ in length")
    order = torch.argsort(scores, descending=True, stable=True)
    scores, labels = scores[order], labels[order]
    last_of_run = torch.ones_like(scores, dtype=torch.bool)
    last_of_run[:-1] = scores[1:] != scores[:-1]
    tps = torch.cumsum(labels, 0)[last_of_run]
    fps = (torch.nonzero(last_of_run).squeeze(1) + 1).to(torch.float64) - tps
    positives, negatives = tps[-1], fps[-1]
    if positives == 0 or negatives == 0:
        return float("nan")
    zero = torch.zeros(1, dtype=torch.float64, device=tps.device)
    tpr = torch.cat([zero, tps / positives])
    fpr = torch.cat([zero, fps / negatives])
    return float(torch.trapezoid(tpr, fpr))
