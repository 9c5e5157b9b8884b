"""Built-in stage models: an MLP, and per-column embeddings of categorical codes + an MLP.

Both return a `tandem.engine.kernels.StageModel` whose ``spec`` rebuilds it
(`tandem.parties.models.model_from_spec`), so exports of them can be predicted with.

**Categorical input of `embedding_mlp`.** A stage over raw features takes one float32 matrix
(one input per party). Its first ``n_dense`` columns are dense features; its last
``len(vocab)`` columns are categorical codes stored as floats (whole numbers, exact below
``2**24``). Code ``0`` of every column is reserved for an unseen or missing category: a code
outside ``[0, vocab[j])`` (negative, too large, NaN) is looked up as ``0``; a fractional code is
truncated. Codes carry no gradient (they are indices); the embedding tables and the MLP do.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tandem.engine.kernels import StageModel, mlp_stage
from tandem.engine.models import mlp_apply, mlp_init
from tandem.errors import ConfigError

#: Largest vocabulary whose codes a float32 column holds exactly (every integer below 2**24).
MAX_VOCAB = 2**24


def mlp(
    in_dims: Sequence[int], hidden: Sequence[int], out_dim: int, *, activate_last: bool = True
) -> StageModel:
    """An MLP over the concatenation of its inputs: ``sum(in_dims) -> *hidden -> out_dim``.

    ReLU between layers; the last layer too when ``activate_last`` (a bottom's cut layer), not
    for a loss stage's logits (pass ``False`` there). Spec ``{"kind": "mlp", ...}``.
    """
    in_dims = _positive_ints("in_dims", in_dims, allow_empty=False)
    hidden = _positive_ints("hidden", hidden)
    out_dim = _positive_int("out_dim", out_dim)
    return mlp_stage(in_dims, hidden, out_dim, activate_last=bool(activate_last))


def embedding_mlp(
    n_dense: int,
    vocab: Sequence[int],
    dim: int | Sequence[int] = 16,
    hidden: Sequence[int] = (64,),
    out_dim: int = 16,
    *,
    activate_last: bool = True,
) -> StageModel:
    """Embeddings of categorical columns, concatenated with the dense columns, then an MLP.

    Args:
      n_dense: dense feature columns (the input's first columns; may be 0).
      vocab: one vocabulary size per categorical column (the input's last columns), counting
        the reserved code 0, so a column with categories 1..k has ``vocab = k + 1``.
      dim: embedding width, one for every column or one per column.
      hidden, out_dim, activate_last: the MLP over ``n_dense + sum(dims)`` columns (see `mlp`).

    The stage has one input of ``n_dense + len(vocab)`` columns (module docstring). Params:
    ``{"embed": [table (vocab[j], dim[j]) per column], "mlp": mlp_init layers}``; tables are
    standard normal (the scale of standardised dense features), the MLP He-initialised.
    Spec ``{"kind": "embedding", ...}``.
    """
    n_dense = _non_negative_int("n_dense", n_dense)
    vocab = _positive_ints("vocab", vocab, allow_empty=False)
    too_big = [v for v in vocab if v > MAX_VOCAB]
    if too_big:
        raise ConfigError(
            f"vocab sizes {too_big} exceed 2**24: float32 feature columns cannot hold such codes "
            "exactly; hash or bucket the category into fewer codes"
        )
    if isinstance(dim, Sequence):
        dims = _positive_ints("dim", dim, allow_empty=False)
        if len(dims) != len(vocab):
            raise ConfigError(
                f"dim lists {len(dims)} widths but vocab {len(vocab)} columns; give one "
                "width per categorical column, or a single int for all"
            )
    else:
        dims = (_positive_int("dim", dim),) * len(vocab)
    hidden = _positive_ints("hidden", hidden)
    out_dim = _positive_int("out_dim", out_dim)
    activate_last = bool(activate_last)
    width = n_dense + len(vocab)
    sizes = [n_dense + sum(dims), *hidden, out_dim]
    bounds = np.asarray(vocab, np.float32)

    def init(key: jax.Array) -> dict[str, Any]:
        k_mlp, *k_tables = jax.random.split(key, len(vocab) + 1)
        tables = [
            jax.random.normal(k, (v, d), jnp.float32)
            for k, v, d in zip(k_tables, vocab, dims, strict=True)
        ]
        return {"embed": tables, "mlp": mlp_init(k_mlp, sizes)}

    def apply(params: dict[str, Any], x: jax.Array) -> jax.Array:
        if x.shape[-1] != width:
            raise ConfigError(
                f"the embedding stage takes {width} columns ({n_dense} dense + {len(vocab)} "
                f"categorical codes), got {x.shape[-1]}"
            )
        codes = jax.lax.stop_gradient(x[..., n_dense:])
        known = (codes >= 0) & (codes < bounds)  # False for NaN
        idx = jnp.where(known, codes, 0).astype(jnp.int32)
        parts = [x[..., :n_dense]] if n_dense else []
        parts += [jnp.take(t, idx[..., j], axis=0) for j, t in enumerate(params["embed"])]
        h = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
        return mlp_apply(params["mlp"], h, activate_last=activate_last)

    spec = {
        "kind": "embedding",
        "n_dense": n_dense,
        "vocab": list(vocab),
        "dim": list(dims) if isinstance(dim, Sequence) else dims[0],
        "hidden": list(hidden),
        "out_dim": out_dim,
        "activate_last": activate_last,
    }
    return StageModel(init, apply, (width,), out_dim, spec)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def _positive_ints(name: str, values: Any, *, allow_empty: bool = True) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ConfigError(f"{name} must be a list of positive ints, got {values!r}")
    if not values and not allow_empty:
        raise ConfigError(f"{name} must list at least one positive int, got {list(values)!r}")
    return tuple(_positive_int(f"{name}[{i}]", v) for i, v in enumerate(values))
