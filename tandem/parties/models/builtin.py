"""Built-in stage models: an MLP, and per-column embeddings of categorical codes + an MLP.

Both return a `tandem.engine.kernels.StageModel` whose ``spec`` rebuilds it
(`tandem.parties.models.model_from_spec`), so exports of them can be predicted with.

**Categorical input of `embedding_mlp`.** A stage over raw features takes one float32 matrix
(one input per party). Its first ``n_dense`` columns are dense features; its last
``len(vocab)`` columns are categorical codes stored as floats (whole numbers, exact below
``2**24``). Code ``0`` of every column is reserved for an unseen or missing category: a code
outside ``[0, vocab[j])`` (negative, too large, NaN) is looked up as ``0``; a fractional code is
truncated. Codes carry no gradient (they are indices); the embedding tables and the MLP do.

**Stacked tables.** By default (``layout="stacked"``) the columns of one embedding width share
a table: column ``j``'s rows follow column ``j-1``'s, up to `TABLE_BYTES` a table, so
``params["embed"]`` holds a few tables (one, for a single ``dim`` and up to 16 MiB of rows).
Each column still reads only its own rows, and the lookup's gradient is one scatter-add per
table. XLA compiles a kernel per distinct array shape, so with 13 columns of different
vocabularies this compiles a stage's forward, backward and optimizer update in about half the
time of one table per column, and runs them as fast or faster on one thread.
``layout="per_column"`` keeps a table per column: the layout of exports written before
stacking, which `tandem.parties.export` still reads.
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
    layout: str = "stacked",
) -> StageModel:
    """Embeddings of categorical columns, concatenated with the dense columns, then an MLP.

    Args:
      n_dense: dense feature columns (the input's first columns; may be 0).
      vocab: one vocabulary size per categorical column (the input's last columns), counting
        the reserved code 0, so a column with categories 1..k has ``vocab = k + 1``.
      dim: embedding width, one for every column or one per column.
      hidden, out_dim, activate_last: the MLP over ``n_dense + sum(dims)`` columns (see `mlp`).
      layout: ``"stacked"`` (the columns of a width share tables of up to `TABLE_BYTES`) or
        ``"per_column"`` (module docstring); the two compute the same function of the same
        initial values.

    The stage has one input of ``n_dense + len(vocab)`` columns (module docstring). Params:
    ``{"embed": [tables], "mlp": mlp_init layers}``: stacked, ``(sum of vocab[j], d)`` tables
    of the columns of width ``d`` in column order (a new one where the next column would
    take a table past `TABLE_BYTES`; `_Stack`), per column one ``(vocab[j], dim[j])`` table
    per column. Every column's rows are standard normal (the
    scale of standardised dense features), drawn from the column's own key, so both layouts
    start from the same values; the MLP is He-initialised. Spec ``{"kind": "embedding", ...}``.
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
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    width = n_dense + len(vocab)
    sizes = [n_dense + sum(dims), *hidden, out_dim]
    bounds = np.asarray(vocab, np.float32)
    stack = _Stack(vocab, dims) if layout == "stacked" else None

    def init(key: jax.Array) -> dict[str, Any]:
        k_mlp, *k_tables = jax.random.split(key, len(vocab) + 1)
        tables = [
            jax.random.normal(k, (v, d), jnp.float32)
            for k, v, d in zip(k_tables, vocab, dims, strict=True)
        ]
        if stack is not None:
            tables = stack.stacked(tables)
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
        if stack is not None:
            parts.append(stack.lookup(params["embed"], idx))
        else:
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
        "layout": layout,
    }
    return StageModel(init, apply, (width,), out_dim, spec)


#: The table layouts of `embedding_mlp` (module docstring).
LAYOUTS = ("stacked", "per_column")
#: Largest stacked table (bytes of float32): a column joins the open table of its width while
#: the sum stays within this, else opens a new one. glibc serves a buffer above its largest
#: mmap threshold (32 MiB) with a fresh mapping at every kernel call that outputs one (a new
#: accumulator, a gradient), whose pages all fault in again: about 5 ms for 38 MB on one core.
TABLE_BYTES = 16 << 20


class _Stack:
    """Where each column's rows lie in the stacked tables, and the lookup through them.

    Column ``j`` of width ``d`` owns rows ``[start[j], start[j] + vocab[j])`` of table
    ``table_of[j]`` (a table holds columns of one width, in order, up to `TABLE_BYTES`).
    `lookup` gathers each column from a static
    slice of its table (as fast as a table of its own) and its gradient is one scatter-add per
    table of all its columns' rows: a `jax.custom_vjp`, since the gradient of a slice is a
    table-sized zero array per column."""

    def __init__(self, vocab: Sequence[int], dims: Sequence[int]) -> None:
        self.table_of: list[int] = []
        self.start: list[int] = []
        rows: list[int] = []  # of each table
        open_table: dict[int, int] = {}  # width -> the table its next column may join
        for v, d in zip(vocab, dims, strict=True):
            t = open_table.get(d)
            if t is None or (rows[t] + v) * d * 4 > TABLE_BYTES:
                t = open_table[d] = len(rows)
                rows.append(0)
            self.table_of.append(t)
            self.start.append(rows[t])
            rows[t] += v
        self.vocab = list(vocab)
        self.tables = len(rows)
        self.lookup = jax.custom_vjp(self._lookup)
        self.lookup.defvjp(self._lookup_fwd, self._lookup_bwd)

    def stacked(self, tables: Sequence[jax.Array]) -> list[jax.Array]:
        """Per-column tables (in column order) stacked into this layout's tables."""
        return [
            jnp.concatenate([x for x, t in zip(tables, self.table_of, strict=True) if t == w])
            for w in range(self.tables)
        ]

    def _lookup(self, tables: list[jax.Array], idx: jax.Array) -> jax.Array:
        """``[rows, sum(dims)]``: column j's embedding of ``idx[..., j]`` (in ``[0, vocab[j])``)."""
        parts = [
            jnp.take(jax.lax.slice_in_dim(tables[t], s, s + v), idx[..., j], axis=0)
            for j, (t, s, v) in enumerate(zip(self.table_of, self.start, self.vocab, strict=True))
        ]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)

    def _lookup_fwd(self, tables, idx):
        return self._lookup(tables, idx), (idx, [t.shape for t in tables])

    def _lookup_bwd(self, residuals, cot):
        idx, shapes = residuals
        rows = [[] for _ in shapes]
        grads = [[] for _ in shapes]
        at = 0
        for j, (t, s) in enumerate(zip(self.table_of, self.start, strict=True)):
            d = shapes[t][1]
            rows[t].append((idx[..., j] + s).reshape(-1))
            grads[t].append(cot[..., at : at + d].reshape(-1, d))
            at += d
        out = [
            jnp.zeros(shape, cot.dtype)
            .at[jnp.concatenate(r)]
            .add(jnp.concatenate(g), mode="promise_in_bounds")
            for shape, r, g in zip(shapes, rows, grads, strict=True)
        ]
        return out, None


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
