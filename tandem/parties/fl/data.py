"""Federated data: scikit-learn's bundled digits split across clients with label skew.

`load_federated_digits` holds out a stratified test set, then splits the training set across
``num_clients`` with a Dirichlet(alpha) label skew: for every class, the class's samples are
divided among clients in proportions drawn from Dir(alpha, ..., alpha). Small alpha = strong
skew (alpha -> infinity tends to IID). Everything is seeded.

`write_digits_csvs` writes the same split as CSV files a federation's parties read through
their ``[data]`` tables (``tandem fl prepare``): one file per client and one held-out file for
the server, columns ``id``, ``pixel_0`` .. ``pixel_63`` (in [0, 1]) and ``digit``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

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


def write_digits_csvs(
    folder: str | os.PathLike[str],
    clients: Sequence[str],
    *,
    alpha: float = 100.0,
    seed: int = 0,
    server: str = "server",
) -> dict[str, str]:
    """Write ``<folder>/<client>.csv`` for every client and ``<folder>/<server>.csv`` (the
    held-out rows); returns ``{party: path}``. Row ids are ``<party>-<i>``, unique across
    files."""
    if len(set(clients)) != len(clients) or server in clients:
        raise ConfigError(f"party names must be distinct, got clients {list(clients)}, {server!r}")
    data = load_federated_digits(len(clients), alpha, seed)
    os.makedirs(folder, exist_ok=True)
    parts = {**dict(zip(clients, data.clients, strict=True)), server: (data.x_test, data.y_test)}
    paths = {}
    header = ",".join(["id", *(f"pixel_{j}" for j in range(data.num_features)), "digit"])
    for name, (x, y) in parts.items():
        path = os.path.join(os.fspath(folder), f"{name}.csv")
        lines = [header]
        for i, (row, label) in enumerate(zip(x, y, strict=True)):
            pixels = ",".join(format(float(v), ".6g") for v in row)
            lines.append(f"{name}-{i},{pixels},{int(label)}")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, path)
        paths[name] = path
    return paths
