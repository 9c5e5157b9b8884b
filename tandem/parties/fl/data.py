"""Federated data: scikit-learn's bundled digits split across clients with label skew.

`load_federated_digits` holds out a stratified test set, then splits the training set across
``num_clients`` with a Dirichlet(alpha) label skew: for every class, the class's samples are
divided among clients in proportions drawn from Dir(alpha, ..., alpha). Small alpha = strong
skew (alpha -> infinity tends to IID). Everything is seeded.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tandem._extras import needs
from tandem.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class FederatedData:
    clients: tuple[tuple[np.ndarray, np.ndarray], ...]  # (x float32 (n, 64), y int32 (n,))
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int = 10

    @property
    def num_features(self) -> int:
        return int(self.x_test.shape[1])


def dirichlet_split(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    *,
    min_size: int = 2,
    max_tries: int = 200,
) -> list[np.ndarray]:
    """Indices per client; retries until every client has at least ``min_size`` samples."""
    if num_clients < 1:
        raise ConfigError(f"num_clients must be >= 1, got {num_clients}")
    if not alpha > 0:
        raise ConfigError(f"Dirichlet alpha must be > 0, got {alpha}")
    if num_clients * min_size > labels.size:
        raise ConfigError(
            f"{labels.size} samples cannot give {num_clients} clients {min_size} samples each; "
            "use fewer clients"
        )
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(props) * idx.size).astype(int)[:-1]
            for i, chunk in enumerate(np.split(idx, cuts)):
                parts[i].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, np.int64)) for p in parts]
    raise ConfigError(
        f"could not give each of {num_clients} clients {min_size} samples with alpha={alpha} "
        f"in {max_tries} draws; raise alpha or use fewer clients"
    )


def load_federated_digits(
    num_clients: int, alpha: float, seed: int, *, test_fraction: float = 0.2
) -> FederatedData:
    """Digits (1797 8x8 images, scaled to [0, 1]) split into a test set and client shards.
    Needs the ``demo`` extra (`tandem._extras`)."""
    with needs("demo", "tandem fl demo (scikit-learn's digits data)"):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

    if not 0 < test_fraction < 1:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    rng = np.random.default_rng(seed)
    shards = dirichlet_split(y_tr, num_clients, alpha, rng)
    return FederatedData(tuple((x_tr[s], y_tr[s]) for s in shards), x_te, y_te)
