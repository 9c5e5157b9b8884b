"""Merging the parameter-server replicas of several data servers at a checkpoint."""

from __future__ import annotations

import numpy as np

from .errors import ElasticError


def merge_replicas(replicas: list[tuple[np.ndarray, ...]]) -> list[np.ndarray]:
    """Merge replica states: mean of float leaves, max of integer leaves (step counters).
    `ElasticError` when the replicas' layouts differ (another model description)."""
    out = []
    for leaves in zip(*replicas, strict=True):
        a0 = leaves[0]
        if any(a.shape != a0.shape or a.dtype != a0.dtype for a in leaves):
            raise ElasticError(
                "replicas have different state layouts; all data servers must "
                "load the same model description"
            )
        stack = np.stack(leaves)
        if a0.dtype.kind == "f":
            out.append(stack.mean(axis=0, dtype=np.float64).astype(a0.dtype))
        else:
            out.append(stack.max(axis=0))
    return out
