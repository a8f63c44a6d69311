"""The answers a job writes per input from a model's outputs (the recipe's `postprocess`): a classifier's top-k
classes, an embedding. The local and Ray engines write them, and the benchmark times them as the job's last stage."""

from __future__ import annotations

from typing import Any

import numpy as np

from accel_opt.recipe.deployed import Postprocess


def topk_record(post: Postprocess, outputs: dict[str, np.ndarray], first_output: str) -> dict[str, Any]:
    """A classifier's answer for one input: top1 and the top-k [class, score] pairs."""
    scores = np.asarray(outputs[post.output or first_output], dtype=np.float64).ravel()
    if post.softmax:
        scores = np.exp(scores - scores.max())
        scores /= scores.sum()
    top = np.argsort(-scores, kind="stable")[: post.topk]
    return labeled(post, {"top1": int(top[0]), "topk": [[int(i), round(float(scores[i]), 6)] for i in top]})


def labeled(post: Postprocess, record: dict[str, Any]) -> dict[str, Any]:
    """A classifier's answer with its classes' names, where the postprocess has them."""
    if not post.labels:
        return record
    name = lambda i: post.labels[i] if 0 <= i < len(post.labels) else str(i)  # noqa: E731
    return {**record, "label": name(record["top1"]), "topk_labels": [name(i) for i, _ in record["topk"]]}


# a normalized vector's values are in [-1, 1]: 5e-8 of rounding, far below float32 kernels' noise
EMBEDDING_DECIMALS = 7


def embedding_record(vector: np.ndarray) -> dict[str, Any]:
    """An embedding's answer for one input: its vector, pooled and normalized."""
    return {"embedding": np.round(np.asarray(vector, dtype=np.float64).ravel(), EMBEDDING_DECIMALS).tolist()}
