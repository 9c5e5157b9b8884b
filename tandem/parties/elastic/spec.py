"""The model description and data shards, loaded through fsspec URLs (local paths,
``memory://``, ``s3://`` ... whatever fsspec can open). Pure numpy; never unpickles.

Model description (JSON or TOML, chosen by the URL's extension)::

    {"sizes": [16, 32, 4], "optimizer": "adam", "lr": 0.01, "batch_size": 32, "seed": 0}

or, for any model of the shared contract (docs/models.md), its ``StageModel.spec`` and the
loss instead of ``sizes``::

    {"model": {"kind": "embedding", ...}, "loss": "binary", "optimizer": "adam", ...}

(`tandem.parties.elastic.data` builds such a description from ``[data]``, ``[model]`` and
``[train]`` TOML tables.)

A shard is an ``.npz`` file with ``x`` (float32, ``[n, sizes[0]]``) and ``y`` (integer class
labels in ``[0, sizes[-1])``, ``[n]``), loaded with ``allow_pickle=False``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import tomllib
from collections.abc import Mapping
from typing import Any

import fsspec
import numpy as np

from tandem.engine.kernels import LOSSES

from .errors import ConfigError

#: The optimizers a model description may name (`tandem.parties.elastic.kernels` builds them).
OPTIMIZERS = ("sgd", "momentum", "adam")


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec:
    """What every party must agree on; `digest` identifies it on the wire.

    Exactly one of ``sizes`` (the built-in MLP: input, hidden..., classes; softmax loss) and
    ``model`` (a `tandem.engine.kernels.StageModel` spec that `model_from_spec` rebuilds, with
    one input) describes the network; ``loss`` is ``"softmax"`` (integer class labels),
    ``"binary"`` or ``"mse"`` (one output column, float labels). ``drop_last``: drop each
    epoch's partial last batch (the default: every batch has one shape, so one compilation),
    or train it as one more, smaller batch (``false``: every row is trained every epoch, at the
    cost of one more compilation for its shape); see `Shard.n_batches`."""

    sizes: tuple[int, ...] = ()
    optimizer: str = "adam"
    lr: float = 0.01
    batch_size: int = 32
    seed: int = 0
    model: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)
    loss: str = "softmax"
    drop_last: bool = True

    def __post_init__(self) -> None:
        if self.model is None and (
            len(self.sizes) < 2 or any(not isinstance(s, int) or s < 1 for s in self.sizes)
        ):
            raise ConfigError(
                f"model 'sizes' must list >= 2 positive ints (input, hidden..., "
                f"classes), got {list(self.sizes)}"
            )
        if self.model is not None:
            if self.sizes:
                raise ConfigError("give the model as 'sizes' or as 'model', not both")
            if not isinstance(self.model, Mapping) or "kind" not in self.model:
                raise ConfigError(
                    f"model 'model' must be a model spec with a 'kind' (docs/models.md), "
                    f"got {self.model!r}"
                )
        if self.loss not in LOSSES:
            raise ConfigError(f"model 'loss' is {self.loss!r}; choose one of {', '.join(LOSSES)}")
        if self.model is None and self.loss != "softmax":
            raise ConfigError(
                "the built-in 'sizes' MLP trains the softmax loss; describe another model "
                "with 'model' (and [model] in TOML) to train 'binary' or 'mse'"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"model 'optimizer' is {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}"
            )
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ConfigError(f"model 'lr' must be a positive number, got {self.lr!r}")
        if not isinstance(self.drop_last, bool):
            raise ConfigError(f"model 'drop_last' must be true or false, got {self.drop_last!r}")
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ConfigError(f"model 'batch_size' must be an int >= 1, got {self.batch_size!r}")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> ModelSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(
                f"unknown model field(s) {sorted(unknown)}; accepted: {sorted(known)}"
            )
        if "sizes" not in raw and "model" not in raw:
            raise ConfigError(
                "model description needs 'sizes', e.g. [16, 32, 4], or a 'model' spec"
            )
        args = dict(raw)
        if "sizes" in args:
            args["sizes"] = tuple(args["sizes"])
        if "lr" in args:
            args["lr"] = float(args["lr"])
        return cls(**args)

    def to_dict(self) -> dict[str, Any]:
        """JSON data; ``model`` and ``loss`` appear only when the model is not ``sizes``."""
        d = {
            "sizes": list(self.sizes),
            "optimizer": self.optimizer,
            "lr": self.lr,
            "batch_size": self.batch_size,
            "seed": self.seed,
        }
        if self.model is not None:
            del d["sizes"]
            d["model"] = json.loads(json.dumps(self.model))
            d["loss"] = self.loss
        if not self.drop_last:  # absent when true, so older descriptions keep their digest
            d["drop_last"] = False
        return d

    @property
    def digest(self) -> str:
        raw = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(raw).hexdigest()[:16]


def _read(url: str) -> bytes:
    try:
        with fsspec.open(url, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(
            f"nothing found at {url!r}; check the path or URL (fsspec URL such "
            "as /abs/path, file://..., memory://..., s3://...)"
        ) from None
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"cannot open {url!r} with fsspec: {exc}") from None


def load_spec(url: str) -> ModelSpec:
    """Read the model description (``.json`` or ``.toml``) from an fsspec URL."""
    raw = _read(url)
    try:
        data = tomllib.loads(raw.decode()) if url.endswith(".toml") else json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"model description at {url!r} is not valid "
            f"{'TOML' if url.endswith('.toml') else 'JSON'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"model description at {url!r} must be an object/table")
    return ModelSpec.from_mapping(data)


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    x: np.ndarray  # float32 [n, d]
    y: np.ndarray  # int32 [n] (softmax) or float32 [n] (binary, mse)

    def n_batches(self, batch_size: int, drop_last: bool = True) -> int:
        """Batches per epoch: the full ones, and with ``drop_last`` false also the partial last
        one (its rows are the permutation's remainder, `batch`)."""
        full, rest = divmod(len(self.y), batch_size)
        return full + (0 if drop_last or not rest else 1)

    def batch(
        self, spec: ModelSpec, epoch: int, index: int, salt: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``index`` of ``epoch``: a seeded permutation per (seed, epoch, salt)."""
        rng = np.random.default_rng([spec.seed, epoch, salt])
        perm = rng.permutation(len(self.y))
        idx = np.sort(perm[index * spec.batch_size : (index + 1) * spec.batch_size])
        return self.x[idx], self.y[idx]


def io_widths(spec: ModelSpec) -> tuple[int, int]:
    """The model's input (feature) and output widths."""
    if spec.model is None:
        return spec.sizes[0], spec.sizes[-1]
    from tandem.parties.models import model_from_spec

    model = model_from_spec(spec.model)
    return int(model.in_dims[0]), int(model.out_dim)


def load_shard(url: str, spec: ModelSpec) -> Shard:
    """Read and validate a shard against ``spec``; errors say what to fix."""
    raw = _read(url)
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            missing = {"x", "y"} - set(z.files)
            if missing:
                raise ConfigError(
                    f"shard {url!r} lacks array(s) {sorted(missing)}; save it "
                    "with np.savez(path, x=features, y=labels)"
                )
            x, y = z["x"], z["y"]
    except (ValueError, OSError) as exc:
        raise ConfigError(f"shard {url!r} is not a readable .npz without pickles: {exc}") from None
    in_dim, out_dim = io_widths(spec)
    if x.ndim != 2 or x.shape[1] != in_dim:
        raise ConfigError(
            f"shard {url!r}: x has shape {x.shape}, expected [n, {in_dim}] (the model's input size)"
        )
    softmax = spec.loss == "softmax"
    if y.shape != (x.shape[0],) or y.dtype.kind not in ("iu" if softmax else "iuf"):
        raise ConfigError(
            f"shard {url!r}: y must be {'integer ' if softmax else ''}labels of shape "
            f"({x.shape[0]},), got {y.dtype} {y.shape}"
        )
    if softmax and y.size and (y.min() < 0 or y.max() >= out_dim):
        raise ConfigError(
            f"shard {url!r}: labels must lie in [0, {out_dim}) (classes), "
            f"got [{y.min()}, {y.max()}]"
        )
    if not softmax and not np.isfinite(y).all():
        raise ConfigError(f"shard {url!r}: y contains NaN or Inf; clean the labels first")
    if not np.isfinite(x).all():
        raise ConfigError(f"shard {url!r}: x contains NaN or Inf; clean the data first")
    if len(y) < spec.batch_size:
        raise ConfigError(
            f"shard {url!r} has {len(y)} rows, fewer than one batch "
            f"({spec.batch_size}); lower batch_size or add data"
        )
    labels = np.int32 if softmax else np.float32
    return Shard(x=np.ascontiguousarray(x, np.float32), y=np.ascontiguousarray(y, labels))


def make_dataset(n_shards: int, rows: int, spec: ModelSpec, *, seed: int = 0) -> list[Shard]:
    """A seeded, learnable classification problem split into ``n_shards`` shards."""
    rng = np.random.default_rng(seed)
    d, k = spec.sizes[0], spec.sizes[-1]
    centers = rng.normal(0, 2.0, (k, d)).astype(np.float32)
    shards = []
    for _ in range(n_shards):
        y = rng.integers(0, k, rows).astype(np.int32)
        x = (centers[y] + rng.normal(0, 1.0, (rows, d))).astype(np.float32)
        shards.append(Shard(x=x, y=y))
    return shards


def save_shard(shard: Shard, url: str) -> None:
    buf = io.BytesIO()
    np.savez(buf, x=shard.x, y=shard.y)
    with fsspec.open(url, "wb") as f:
        f.write(buf.getvalue())
