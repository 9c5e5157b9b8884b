"""Seeded batch sampling shared by every role (pure numpy)."""

from __future__ import annotations

import numpy as np

from .errors import ConfigError


def epoch_batches(n_rows: int, batch_size: int, epoch: int, seed: int, *,
                  shuffle: bool = True, drop_last: bool = False) -> list[np.ndarray]:
    """Row indices of each batch of ``epoch``: a permutation seeded by ``(seed, epoch)``."""
    if n_rows < 1:
        raise ConfigError("the training set is empty")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    order = (np.random.default_rng([seed, epoch]).permutation(n_rows) if shuffle
             else np.arange(n_rows))
    stops = range(batch_size, n_rows + (0 if drop_last else batch_size), batch_size)
    return [order[i - batch_size:min(i, n_rows)] for i in stops if i - batch_size < n_rows]
