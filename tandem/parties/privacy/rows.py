"""Per-row clipping and norm alignment of a cut tensor (rows first, any shape after). Pure."""

from __future__ import annotations

import numpy as np

_TINY = np.float32(1e-12)


def row_norms(x: np.ndarray) -> np.ndarray:
    """L2 norm of each row (over every axis after the first), float32 ``[rows]``."""
    flat = np.asarray(x, np.float32).reshape(len(x), -1)
    return np.sqrt(np.einsum("ij,ij->i", flat, flat))


def clip_rows(x: np.ndarray, bound: float) -> np.ndarray:
    """``x`` with every row scaled down to L2 norm at most ``bound`` (shorter rows unchanged).
    Invariant: ``row_norms(clip_rows(x, c)) <= c`` up to float rounding."""
    norms = row_norms(x)
    scale = np.minimum(np.float32(1), np.float32(bound) / np.maximum(norms, _TINY))
    return np.asarray(x, np.float32) * scale.reshape(-1, *([1] * (x.ndim - 1)))


def align_rows(x: np.ndarray, norm: float) -> np.ndarray:
    """``x`` with every nonzero row scaled to L2 norm exactly ``norm`` (zero rows stay zero)."""
    norms = row_norms(x)
    scale = np.where(norms > _TINY, np.float32(norm) / np.maximum(norms, _TINY), np.float32(0))
    return np.asarray(x, np.float32) * scale.reshape(-1, *([1] * (x.ndim - 1))).astype(np.float32)


__all__ = ["align_rows", "clip_rows", "row_norms"]
