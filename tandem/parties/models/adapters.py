"""Adapters: a plain JAX function pair, a Flax (linen, nnx) or an Equinox model as a `StageModel`.

Every adapter returns a `tandem.engine.kernels.StageModel` (``init(key) -> params``,
``apply(params, *inputs) -> output``) that the engine jits and differentiates like the
built-ins. Each checks the model once, abstractly (`jax.eval_shape`, no compute), and reads its
output from that: one ``[batch, ...]`` array of any rank >= 2 and any cut dtype (float32,
bfloat16, float16) gives the model's ``out_shape`` (after the batch), ``out_dtype`` and
``out_dim`` (the flat width ``prod(out_shape)``; when given, it must agree).

Inputs (``in_dims``, one entry per input): a width ``d`` is a ``float32[batch, d]`` matrix
(feature columns, or another stage's float32 matrix output); ``(shape, dtype)`` is a
``dtype[batch, *shape]`` array, e.g. ``((4, 8), "bfloat16")`` for a top stage reading a bottom
whose cut is bfloat16 of shape ``[batch, 4, 8]``.

Parameters: `from_functions` hands the engine the pytree the user's ``init`` returns. The Flax
and Equinox adapters hand it nested dicts named by each parameter's path
(`tandem.parties.models.naming`), which the engine trains and an export stores.

Export: a model built from user code is identified by the factory that builds it. Pass
``reference="pkg.mod:fn"`` (and its JSON ``kwargs``) so that ``fn(**kwargs)`` returns this model;
the spec becomes ``{"kind": "factory", "factory": reference, "kwargs": kwargs}``. A model built
by `tandem.parties.models.load_factory` (TOML ``factory = ...``) gets that spec by itself.
Without a reference the model trains, but `tandem.parties.split.inference.export_party`
refuses it, as nothing could rebuild it.

Flax and Equinox are optional: they are imported on the first call of their adapter, which
raises `ConfigError` naming the extra to install when they are missing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from tandem._extras import needs
from tandem.engine.kernels import StageInput, StageModel, derive_stage, input_structs
from tandem.errors import ConfigError

from .builtin import _positive_int
from .factory import factory_spec
from .naming import NamedTree


def from_functions(
    init: Callable[[jax.Array], Any],
    apply: Callable[..., jax.Array],
    in_dims: Sequence[StageInput],
    out_dim: int | None = None,
    *,
    reference: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> StageModel:
    """A plain JAX pair: ``init(key) -> params`` (a pytree of arrays), ``apply(params, *xs)``.

    Both must be pure (no hidden state) and jit-able. For export, ``params`` must be dicts with
    str keys, lists and tuples of arrays (what `tandem.parties.export` stores).
    """
    if not callable(init) or not callable(apply):
        raise ConfigError("from_functions needs two callables: init(key) and apply(params, *xs)")
    return _checked(init, apply, in_dims, out_dim, reference, kwargs, "from_functions")


def from_flax_linen(
    module: Any,
    in_dims: Sequence[StageInput],
    out_dim: int | None = None,
    *,
    reference: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> StageModel:
    """A `flax.linen.Module` whose ``__call__`` takes one array per input (``in_dims``, see the
    module docstring).

    ``init(key)`` is the ``"params"`` collection of ``module.init(key, *zeros of one row of
    each input)``: what the engine trains and exports. The other collections (e.g.
    ``batch_stats``) are not parameters: they are held fixed at their value from
    ``module.init(PRNGKey(0), ...)`` when adapted (they would otherwise get real gradients, a
    running mean's for one, and be trained). ``apply`` is ``module.apply`` on both. Use modules
    that do not mutate them (``BatchNorm(use_running_average=True)``, deterministic
    ``Dropout``).
    """
    linen = _optional("flax.linen", "flax")
    if not isinstance(module, linen.Module):
        raise ConfigError(f"from_flax_linen takes a flax.linen.Module, got {type(module).__name__}")
    what = f"flax linen {type(module).__name__}"
    rows = tuple(jnp.zeros(a.shape, a.dtype) for a in _structs(in_dims, what, rows=1))
    abstract = jax.eval_shape(module.init, jax.random.PRNGKey(0), *rows)
    names = NamedTree({"params": abstract.get("params", {})}, what=what)
    fixed: dict[str, Any] = {}
    if any(c != "params" for c in abstract):  # computed without the params (jit prunes them)
        fixed = jax.jit(lambda key: _without_params(module.init(key, *rows)))(jax.random.PRNGKey(0))

    def init(key: jax.Array) -> dict[str, Any]:
        return names.named({"params": module.init(key, *rows).get("params", {})})

    def apply(params: dict[str, Any], *xs: jax.Array) -> jax.Array:
        return module.apply({**fixed, **names.restore(params)}, *xs)

    return _checked(init, apply, in_dims, out_dim, reference, kwargs, what)


def _without_params(variables: Mapping[str, Any]) -> dict[str, Any]:
    return {c: v for c, v in variables.items() if c != "params"}


def from_flax_nnx(
    module: Any,
    in_dims: Sequence[StageInput],
    out_dim: int | None = None,
    *,
    reference: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> StageModel:
    """A `flax.nnx.Module` (already built, with its own ``nnx.Rngs``) called on the batch.

    ``nnx.split(module, nnx.Param, ...)`` gives the graph, the parameters (``nnx.Param``
    variables: what the engine trains and exports) and the other state; ``apply`` merges them
    (`nnx.merge`) and calls the module, so it is a pure, jit-able function of the parameters.
    The other state (RNG counters, batch statistics) is held fixed at its value when adapted:
    use deterministic modules (no active dropout, BatchNorm on running averages).

    ``init(key)`` returns a copy of the module's parameters; the key is not used, as the module
    was initialised when it was built. To seed it, build it in a factory from a ``seed`` kwarg.
    """
    nnx = _optional("flax.nnx", "flax")
    if not isinstance(module, nnx.Module):
        raise ConfigError(f"from_flax_nnx takes a flax.nnx.Module, got {type(module).__name__}")
    what = f"flax nnx {type(module).__name__}"
    graphdef, state, rest = nnx.split(module, nnx.Param, ...)
    names = NamedTree(state, what=what, strip="value")
    built = names.named(state)

    def init(key: jax.Array) -> dict[str, Any]:
        return jax.tree_util.tree_map(jnp.array, built)  # a copy: the engine donates params

    def apply(params: dict[str, Any], *xs: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, names.restore(params), rest)(*xs)

    try:
        return _checked(init, apply, in_dims, out_dim, reference, kwargs, what)
    except ConfigError as exc:
        errors = _optional("flax.errors", "flax")
        if not isinstance(exc.__cause__, errors.TraceContextError):
            raise
        raise ConfigError(
            f"{exc}\n{what} mutates its state when called (RNG counters of active dropout, "
            "batch statistics of BatchNorm in training mode), which is held fixed: build it "
            "deterministic (nnx.Dropout(..., deterministic=True), "
            "nnx.BatchNorm(..., use_running_average=True), or module.eval())"
        ) from exc.__cause__


def from_equinox(
    module: Any,
    in_dims: Sequence[StageInput],
    out_dim: int | None = None,
    *,
    per_example: bool = True,
    reference: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> StageModel:
    """An `equinox.Module` (already built, with its own key).

    ``eqx.partition(module, eqx.is_inexact_array)`` gives the parameters (floating arrays:
    what the engine trains and exports) and the rest (functions, ints, integer arrays), held
    fixed; ``apply`` recombines them (`eqx.combine`) and calls the module. ``per_example``
    (the default, Equinox's convention: ``eqx.nn.MLP`` maps one example) vmaps the module over
    the batch; pass ``False`` for a module that takes the batch itself.

    ``init(key)`` returns a copy of the module's parameters; the key is not used, as the module
    was initialised when it was built. To seed it, build it in a factory from a ``seed`` kwarg.
    """
    eqx = _optional("equinox", "equinox")
    if not isinstance(module, eqx.Module):
        raise ConfigError(f"from_equinox takes an equinox.Module, got {type(module).__name__}")
    what = f"equinox {type(module).__name__}"
    params, static = eqx.partition(module, eqx.is_inexact_array)
    names = NamedTree(params, what=what)
    built = names.named(params)
    call = bool(per_example)

    def init(key: jax.Array) -> dict[str, Any]:
        return jax.tree_util.tree_map(jnp.array, built)  # a copy: the engine donates params

    def apply(params: dict[str, Any], *xs: jax.Array) -> jax.Array:
        model = eqx.combine(names.restore(params), static)
        return jax.vmap(model)(*xs) if call else model(*xs)

    return _checked(init, apply, in_dims, out_dim, reference, kwargs, what)


def _checked(
    init: Callable[[jax.Array], Any],
    apply: Callable[..., jax.Array],
    in_dims: Sequence[StageInput],
    out_dim: int | None,
    reference: str | None,
    kwargs: Mapping[str, Any] | None,
    what: str,
) -> StageModel:
    """The `StageModel`, its output read from ``apply`` on ``in_dims`` abstractly
    (`tandem.engine.kernels.derive_stage`), ``out_dim`` (when given) checked against it."""
    _structs(in_dims, what, rows=2)
    if reference is None and kwargs is not None:
        raise ConfigError(f"{what}: kwargs describe a factory call; give reference= as well")
    spec = None if reference is None else factory_spec(reference, kwargs)
    try:
        model = derive_stage(init, apply, list(in_dims), spec)
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from exc.__cause__
    if out_dim is not None and _positive_int("out_dim", out_dim) != model.out_dim:
        shape = list(model.out_shape or ())
        got = f"{shape[0]} columns" if len(shape) == 1 else f"{shape} per row ({model.out_dim})"
        raise ConfigError(f"{what}: out_dim is {out_dim} but apply returns {got}")
    return model


def _structs(in_dims: Sequence[StageInput], what: str, rows: int) -> list[jax.ShapeDtypeStruct]:
    """The abstract inputs of ``rows`` rows; `ConfigError` naming the adapter for a bad
    ``in_dims`` (none, or an entry neither a width nor ``(shape, dtype)``)."""
    if isinstance(in_dims, (str, bytes)) or not isinstance(in_dims, Sequence) or not in_dims:
        raise ConfigError(
            f"{what}: in_dims must list one entry per input (a width, or (shape, dtype)), got "
            f"{in_dims!r}"
        )
    try:
        return input_structs(list(in_dims), rows)[0]
    except ConfigError as exc:
        raise ConfigError(f"{what}: in_dims {list(in_dims)!r}: {exc}") from None


def _optional(module: str, extra: str) -> ModuleType:
    with needs(extra, f"the {module} adapter"):
        return importlib.import_module(module)
