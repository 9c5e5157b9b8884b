"""Models from data: a `StageModel.spec` (JSON, as an export records it) or a per-stage TOML table.

Spec kinds (`model_from_spec`)::

    {"kind": "mlp", "in_dims": [8], "hidden": [64, 32], "out_dim": 16, "activate_last": true}
    {"kind": "embedding", "n_dense": 5, "vocab": [12, 4], "dim": 16, "hidden": [64],
     "out_dim": 16, "activate_last": true}
    {"kind": "factory", "factory": "mypkg.models:bottom", "kwargs": {"width": 32}}

TOML forms (`model_from_toml`, one table per stage, e.g. ``[model.bottom_leader]``)::

    kind = "mlp"        hidden = [64, 32]   out = 16      activate_last = true
    kind = "embedding"  vocab = [12, 4]     dim = 16      hidden = [64]   out = 16
    factory = "mypkg.models:bottom"         kwargs = { width = 32 }

Importing this module registers the ``embedding`` and ``factory`` kinds with
`tandem.engine.kernels.register_model_kind`, so the engine's `model_from_spec` builds them too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.engine import kernels
from tandem.engine.kernels import StageModel
from tandem.errors import ConfigError

from .builtin import embedding_mlp, mlp
from .factory import load_factory


def _factory_kind(factory: str, kwargs: Mapping[str, Any] | None = None) -> StageModel:
    return load_factory(factory, kwargs)


kernels.register_model_kind("embedding", embedding_mlp)
kernels.register_model_kind("factory", _factory_kind)

#: Accepted keys of a stage's TOML table, per kind.
TOML_KEYS: dict[str, tuple[str, ...]] = {
    "mlp": ("kind", "hidden", "out", "activate_last"),
    "embedding": ("kind", "vocab", "dim", "hidden", "out", "activate_last"),
    "factory": ("kind", "factory", "kwargs"),
}


def model_from_spec(spec: Mapping[str, Any]) -> StageModel:
    """The `StageModel` a spec describes (kinds ``mlp``, ``embedding``, ``factory``, and any
    registered with `tandem.engine.kernels.register_model_kind`); `ConfigError` otherwise."""
    return kernels.model_from_spec(spec)


def model_from_toml(
    table: Mapping[str, Any],
    *,
    in_dims: Sequence[int],
    out_dim: int | None = None,
    loss: bool = False,
    vocab: Sequence[int] | None = None,
    where: str = "model",
) -> StageModel:
    """The `StageModel` of one stage's TOML table (forms in the module docstring).

    Args:
      in_dims: the stage's input widths (feature columns, or the widths of the stages it
        reads), in input order.
      out_dim: the width the stage must output (e.g. the loss stage's label width), or None;
        it is ``out``'s default, and a table or factory giving another width is refused.
      loss: the stage computes the loss: its MLP's last layer stays linear unless
        ``activate_last`` says otherwise.
      vocab: vocabulary sizes of the categorical columns as the data's preprocessing found
        them (the last columns of the features); the default of ``vocab`` for ``embedding``.
      where: the table's name in messages, e.g. ``"model.bottom_leader"``.

    Raises `ConfigError` naming ``where.key`` for unknown keys (listing the accepted ones),
    missing or mistyped values, and widths that do not fit ``in_dims``/``out_dim``.
    """
    if not isinstance(table, Mapping):
        raise ConfigError(f"[{where}] must be a table, got {table!r}")
    kind = table.get("kind", "factory" if "factory" in table else None)
    if kind not in TOML_KEYS:
        raise ConfigError(
            f"{where}.kind is {kind!r}; choose one of {sorted(TOML_KEYS)}, "
            'or name a factory: factory = "package.module:function"'
        )
    unknown = sorted(set(table) - set(TOML_KEYS[kind]))
    if unknown:
        raise ConfigError(
            f"[{where}] has unknown keys {unknown}; a {kind!r} model accepts "
            f"{list(TOML_KEYS[kind])}"
        )
    dims = [int(d) for d in in_dims]
    if kind == "factory":
        if "factory" not in table:
            raise ConfigError(f'[{where}] needs factory = "package.module:function"')
        kwargs = table.get("kwargs", {})
        if not isinstance(kwargs, Mapping):
            raise ConfigError(f"{where}.kwargs must be a table, got {kwargs!r}")
        model = load_factory(table["factory"], kwargs)
        if list(model.in_dims) != dims:
            raise ConfigError(
                f"[{where}]: factory {table['factory']!r} built a model over inputs of widths "
                f"{list(model.in_dims)}, but the stage's inputs have widths {dims}; pass the "
                "right widths in kwargs"
            )
        if out_dim is not None and model.out_dim != out_dim:
            raise ConfigError(
                f"[{where}]: factory {table['factory']!r} built a model with {model.out_dim} "
                f"outputs, but the stage must output {out_dim}"
            )
        return model
    out = table.get("out", out_dim)
    if out is None:
        raise ConfigError(f"[{where}] needs out = <the stage's output width>")
    if out_dim is not None and out != out_dim:
        raise ConfigError(f"{where}.out is {out!r} but the stage must output {out_dim}")
    if "hidden" not in table:
        raise ConfigError(
            f"[{where}] needs hidden = [<widths>] (hidden = [] for a single linear layer)"
        )
    hidden = table["hidden"]
    activate_last = table.get("activate_last", not loss)
    if not isinstance(activate_last, bool):
        raise ConfigError(f"{where}.activate_last must be true or false, got {activate_last!r}")
    try:
        if kind == "mlp":
            return mlp(dims, hidden, out, activate_last=activate_last)
        return _embedding(table, dims, hidden, out, activate_last, vocab, where)
    except ConfigError as exc:
        raise ConfigError(f"[{where}]: {exc}") from None


def _embedding(
    table: Mapping[str, Any],
    dims: list[int],
    hidden: Any,
    out: Any,
    activate_last: bool,
    vocab: Sequence[int] | None,
    where: str,
) -> StageModel:
    if len(dims) != 1:
        raise ConfigError(
            f"an embedding model reads one input (the party's feature columns), this stage has "
            f"{len(dims)}; use it for a bottom stage"
        )
    sizes = table.get("vocab", None if vocab is None else list(vocab))
    if sizes is None:
        raise ConfigError(
            "vocab is missing: give one vocabulary size per categorical column "
            "(including the reserved code 0), e.g. vocab = [12, 4]"
        )
    if vocab is not None and list(sizes) != list(vocab):
        raise ConfigError(
            f"vocab is {list(sizes)} but the data's categorical columns have vocabularies "
            f"{list(vocab)}; drop vocab from the table to use the data's"
        )
    if not isinstance(sizes, Sequence) or isinstance(sizes, str):
        raise ConfigError(f"vocab must be a list of ints, got {sizes!r}")
    n_dense = dims[0] - len(sizes)
    if n_dense < 0:
        raise ConfigError(
            f"vocab lists {len(sizes)} categorical columns but the features have only "
            f"{dims[0]} columns"
        )
    return embedding_mlp(
        n_dense, sizes, table.get("dim", 16), hidden, out, activate_last=activate_last
    )
