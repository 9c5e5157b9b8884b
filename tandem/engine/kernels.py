"""Stage models and their jitted kernels. Pure functions of (params, inputs); no hidden state.

A `StageModel` is an ``(init, apply)`` pair: ``init(key) -> params`` and
``apply(params, *inputs) -> output``. `StageKernels` jits, once per stage:

* ``forward(params, *xs) -> (out, vjp)``  the output and its pullback (residuals kept, so the
  backward pass does not recompute the forward);
* ``backward(vjp, cot, acc) -> (acc + param_grads, input_grads)``;
* ``loss_step(params, acc, loss_acc, labels, scale, *xs, mask=None) -> (acc + param_grads,
  loss_acc + loss, logits, input_grads)`` for the loss stage, fusing forward and backward;
  ``scale`` is the micro-batch's share ``1/B`` so summed micro-batch gradients equal the full
  batch's mean-loss gradient; ``mask`` (``bool[rows]``, optional) marks the real rows of a
  group padded to a bucket size (`tandem.engine.microbatch.bucket_rows`): the others add
  nothing to the loss, and so nothing to any gradient;
* ``predict(params, *xs)``; ``zeros(params)`` (a fresh accumulator);
  ``update(params, opt_state, grads)`` (optax).

``differentiable`` (one flag per input) marks the inputs whose gradients are wanted: a stage
over raw features passes ``False`` for them, and its kernels neither compute nor return those
gradients (``None`` in their place in ``input_grads``): for a bottom MLP, one matmul fewer in
the backward pass.

Gradient and loss accumulation happen inside the backward kernels (``acc``, ``loss_acc`` are
carried on the device), so a micro-batch costs one dispatch and no host synchronisation beyond
the tensors it must send: a ``float(loss)`` or an extra ``accumulate`` call per micro-batch is
a device round trip each (a stall on a GPU; on a CPU, where the calling thread gives up Python's
lock around it, a chance for every other thread to take it).

**Donation.** ``update`` takes ownership of its ``params`` and ``opt_state`` and ``backward`` and
``loss_step`` of their ``acc`` (``donate_argnums``): XLA writes the results into those buffers
instead of allocating new ones, which shortens the update on every batch's critical path. The
arrays passed in are deleted by the call: anything handed across the API is copied with
`owned_copy` (`tandem.parties.split.stages.StageHandler`'s parameters, `SplitParty.params` and
`restore`).

**The update's compiler options.** On a CPU, ``update`` compiles with LLVM's optimisation
level 1 (`UPDATE_COMPILER_OPTIONS`) instead of XLA's default 3: its work is one elementwise pass
per parameter array (an optimizer's moments and the new parameters), which level 3 compiles
into slower loops. For the 9.7M-parameter `bench.scale` stages (Adam, 13 embedding tables each)
the update runs in 0.6 of the time and compiles in 0.6 of the time. The other kernels keep the
default (a forward pass of embedding lookups and matmuls runs slower at level 1). Other backends
compile every kernel with their defaults.

Each kernel counts its traces (``kernels.traces[name]``), so a test can prove that micro-batches
of equal shape never retrace.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from tandem.errors import ConfigError

from .models import mlp_apply, mlp_init
from .topology import CUT_DTYPES

#: XLA compiler options of the ``update`` kernel on a CPU (module docstring)
UPDATE_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def update_compiler_options() -> dict[str, Any] | None:
    """`UPDATE_COMPILER_OPTIONS` when JAX's default backend is the CPU, else None (also on a
    JAX whose ``jax.jit`` takes no ``compiler_options``)."""
    if jax.default_backend() != "cpu" or not _JIT_TAKES_OPTIONS:
        return None
    return dict(UPDATE_COMPILER_OPTIONS)


_JIT_TAKES_OPTIONS = "compiler_options" in inspect.signature(jax.jit).parameters


@dataclasses.dataclass(frozen=True)
class StageModel:
    """A stage's model: ``init(key) -> params``, ``apply(params, *inputs) -> output``.

    ``in_dims`` (one per input) and ``out_dim`` describe the feature widths, so plans, task specs
    and received tensors can be checked before any compute. ``spec`` (optional JSON data, e.g.
    ``{"kind": "mlp", ...}``) lets `model_from_spec` rebuild the same model from an export.

    The output is ``out_dtype[rows, *out_shape]``: ``out_shape`` (the shape after the rows,
    ``(out_dim,)`` when not given) and ``out_dtype`` (one of `CUT_DTYPES`, ``"float32"`` when
    not given). A stage reading another stage's output takes it in that shape and dtype, and
    its cotangent comes back in the same shape and dtype.

    Invariant: ``out_dim == prod(out_shape)`` (the flat width; an input's ``in_dims`` entry is
    the flat width of the stage it reads). `derive_stage` fills ``out_*`` from ``apply``.
    """

    init: Callable[[jax.Array], Any]
    apply: Callable[..., jax.Array]
    in_dims: tuple[int, ...]
    out_dim: int
    spec: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)
    out_shape: tuple[int, ...] | None = None
    out_dtype: str = "float32"

    def __post_init__(self) -> None:
        try:
            shape = (self.out_dim,) if self.out_shape is None else _sizes(self.out_shape)
        except TypeError:
            shape = ()
        if not shape or min(shape) < 1:
            raise ConfigError(
                f"out_shape must be the positive sizes after the rows, e.g. (4, 4); got "
                f"{self.out_shape!r}"
            )
        if math.prod(shape) != self.out_dim:
            raise ConfigError(
                f"out_shape {list(shape)} holds {math.prod(shape)} values per row but out_dim "
                f"is {self.out_dim}; out_dim is the flat width prod(out_shape)"
            )
        if self.out_dtype not in CUT_DTYPES:
            raise ConfigError(
                f"out_dtype {self.out_dtype!r} is not a cut dtype; choose one of {list(CUT_DTYPES)}"
            )
        object.__setattr__(self, "out_shape", shape)

    @property
    def cut(self) -> dict[str, Any]:
        """``{"shape": [...], "dtype": ...}``: the output per row, as JSON data."""
        return {"shape": list(self.out_shape or ()), "dtype": self.out_dtype}


def _sizes(shape: Any) -> tuple[int, ...]:
    return tuple(operator.index(d) for d in shape)


#: One input of a stage, as `derive_stage` and `check_inputs` take it: a width (a
#: ``float32[rows, width]`` matrix, e.g. feature columns) or ``(shape after the rows, dtype)``
#: (another stage's output: its ``out_shape`` and ``out_dtype``).
StageInput = int | tuple[Sequence[int], str]
_PROBE_ROWS = 2  # rows of the abstract inputs: 2, so a row axis cannot pass for a size 1 axis


def input_structs(
    inputs: Sequence[StageInput], rows: int
) -> tuple[list[jax.ShapeDtypeStruct], list[int], str]:
    """``(abstract arrays of ``rows`` rows, flat widths, how to name the inputs in a message)``;
    `ConfigError` for an input that is neither a positive width nor ``(positive sizes, a cut
    dtype)``."""
    structs, widths, names = [], [], []
    for i, x in enumerate(inputs):
        shape: tuple[int, ...]
        try:
            if isinstance(x, bool):  # not a width, though Python counts it as an int
                shape, dtype = (), ""
            elif isinstance(x, (tuple, list)):
                raw_shape, dtype = x
                shape = _sizes(raw_shape)
            else:
                shape, dtype = (operator.index(x),), "float32"
        except (TypeError, ValueError):
            shape, dtype = (), ""
        if not shape or min(shape) < 1 or dtype not in CUT_DTYPES:
            raise ConfigError(
                f"input {i} is {x!r}; give a width (int) or (shape after the rows, dtype) with "
                f"positive sizes and a dtype of {list(CUT_DTYPES)}, e.g. ((4, 8), 'bfloat16')"
            )
        structs.append(jax.ShapeDtypeStruct((rows, *shape), jnp.dtype(dtype)))
        widths.append(math.prod(shape))
        names.append(f"{dtype}[rows, {', '.join(str(d) for d in shape)}]")
    if all(isinstance(x, int) for x in inputs):
        return structs, widths, f"inputs of widths {widths}"
    return structs, widths, f"inputs {', '.join(names)}"


def _abstract_output(
    init: Callable[[jax.Array], Any], apply: Callable[..., jax.Array], inputs: Sequence[StageInput]
) -> tuple[Any, list[int]]:
    """``jax.eval_shape`` of ``apply(init(key), *inputs)`` on 2 rows (no compute), and the
    inputs' flat widths; `ConfigError` when it fails."""
    structs, widths, named = input_structs(inputs, _PROBE_ROWS)
    try:
        out = jax.eval_shape(
            lambda key, *xs: apply(init(key), *xs), jax.random.PRNGKey(0), *structs
        )
    except Exception as exc:
        raise ConfigError(
            f"apply(init(key), *inputs) fails on {named}: {type(exc).__name__}: {exc}"
        ) from exc
    return out, widths


def derive_stage(
    init: Callable[[jax.Array], Any],
    apply: Callable[..., jax.Array],
    inputs: Sequence[StageInput],
    spec: Mapping[str, Any] | None = None,
) -> StageModel:
    """The `StageModel` of ``(init, apply)`` with ``out_dim``, ``out_shape`` and ``out_dtype``
    read from ``jax.eval_shape`` (no compute).

    ``inputs``: per input, its width (a ``float32[rows, width]`` matrix, e.g. feature columns)
    or ``(shape after the rows, dtype)`` (another stage's output: its ``out_shape`` and
    ``out_dtype``). Raises `ConfigError` when ``apply`` fails on such inputs or does not return
    one ``[rows, ...]`` array of a dtype in `CUT_DTYPES`, or when a leaf of ``init``'s
    parameters is not a floating array (the engine differentiates and updates every leaf).
    """
    _check_floating_params(init)
    out, in_dims = _abstract_output(init, apply, inputs)
    got = getattr(out, "shape", None)
    if got is None or len(got) < 2 or got[0] != _PROBE_ROWS:
        raise ConfigError(
            "apply must return one [rows, ...] array (rank 2 or more, rows first; e.g. one "
            "[batch, out_dim] array), got "
            f"{jax.tree_util.tree_map(lambda a: a.shape, out)} for {_PROBE_ROWS} rows"
        )
    out_shape = tuple(int(d) for d in got[1:])
    return StageModel(
        init,
        apply,
        tuple(in_dims),
        math.prod(out_shape),
        spec,
        out_shape=out_shape,
        out_dtype=jnp.dtype(out.dtype).name,
    )


def _check_floating_params(init: Callable[[jax.Array], Any]) -> None:
    """`ConfigError` naming the first leaf of ``init(key)`` that is not a floating array
    (checked abstractly); `_abstract_output` reports an ``init`` that fails."""
    try:
        params = jax.eval_shape(init, jax.random.PRNGKey(0))
    except Exception:
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise ConfigError(
                f"parameter {jax.tree_util.keystr(path)} is {jnp.dtype(leaf.dtype).name}: the "
                "engine differentiates and updates every leaf of init's parameters, so each "
                "must be a floating array; keep integer constants (indices, counts) out of "
                "params, e.g. in apply's closure"
            )


def check_inputs(model: StageModel, inputs: Sequence[StageInput]) -> None:
    """`ConfigError` unless ``model`` takes ``inputs`` (as in `derive_stage`) and returns the
    output it declares (``out_dtype[rows, *out_shape]``), checked abstractly (no compute).

    Use it where a stage built over flat widths (``in_dims``) is to read another stage's cut
    of another shape or dtype: the message says what fails."""
    out, _ = _abstract_output(model.init, model.apply, inputs)
    got = getattr(out, "shape", None)
    want = (_PROBE_ROWS, *(model.out_shape or ()))
    if got is None or tuple(got) != want or jnp.dtype(out.dtype).name != model.out_dtype:
        seen = jax.tree_util.tree_map(lambda a: f"{a.dtype}{list(a.shape)}", out)
        raise ConfigError(
            f"on these inputs apply returns {seen} for {_PROBE_ROWS} rows, but the stage "
            f"declares {model.out_dtype}{list(want)}"
        )


def mlp_stage(
    in_dims: Sequence[int], hidden: Sequence[int], out_dim: int, *, activate_last: bool = True
) -> StageModel:
    """An MLP over the concatenation of its inputs (a bottom has one input; a top several)."""
    in_dims = tuple(int(d) for d in in_dims)
    sizes = [sum(in_dims), *hidden, out_dim]

    def init(key):
        return mlp_init(key, sizes)

    def apply(params, *xs):
        x = xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=-1)
        return mlp_apply(params, x, activate_last=activate_last)

    spec = {
        "kind": "mlp",
        "in_dims": list(in_dims),
        "hidden": [int(h) for h in hidden],
        "out_dim": int(out_dim),
        "activate_last": bool(activate_last),
    }
    return StageModel(init, apply, in_dims, int(out_dim), spec)


#: Model kinds `model_from_spec` can rebuild: kind -> builder taking the spec's other fields.
#: Other kinds are added with `register_model_kind` (`tandem.parties.models` adds its own).
MODEL_KINDS: dict[str, Callable[..., StageModel]] = {"mlp": mlp_stage}


def register_model_kind(kind: str, builder: Callable[..., StageModel]) -> None:
    """Let `model_from_spec` rebuild ``{"kind": kind, **fields}`` as ``builder(**fields)``.

    Registering the same builder again is a no-op; another builder under a taken kind raises
    `ConfigError`, so a kind always means one model.
    """
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"a model kind must be a non-empty string, got {kind!r}")
    if MODEL_KINDS.get(kind, builder) is not builder:
        raise ConfigError(
            f"model kind {kind!r} is already registered to {MODEL_KINDS[kind]!r}; pick another kind"
        )
    MODEL_KINDS[kind] = builder


def model_from_spec(spec: Mapping[str, Any]) -> StageModel:
    """The `StageModel` described by ``spec`` (a `StageModel.spec`, e.g. read from an export).

    Raises `ConfigError` naming the field when the spec is not one this Tandem can build.
    """
    if not isinstance(spec, Mapping) or spec.get("kind") not in MODEL_KINDS:
        kind = spec.get("kind") if isinstance(spec, Mapping) else spec
        raise ConfigError(
            f"model kind {kind!r} is unknown; this Tandem builds {sorted(MODEL_KINDS)}"
        )
    fields = {k: v for k, v in spec.items() if k != "kind"}
    try:
        return MODEL_KINDS[spec["kind"]](**fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model spec {dict(spec)!r} is malformed: {exc}") from None


# -- losses: per-sample loss from (logits, labels) ------------------------------------------------
def binary_logistic(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.sigmoid_binary_cross_entropy(
        logits.reshape(labels.shape), labels.astype(logits.dtype)
    )


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels.astype(jnp.int32))


def mean_squared(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return 0.5 * jnp.sum(
        (
            logits.reshape(labels.shape[0], -1)
            - labels.reshape(labels.shape[0], -1).astype(logits.dtype)
        )
        ** 2,
        axis=-1,
    )


LOSSES = {"binary": binary_logistic, "softmax": softmax_cross_entropy, "mse": mean_squared}


def get_loss(name: str) -> Callable:
    try:
        return LOSSES[name]
    except KeyError:
        raise ConfigError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}") from None


def _restrict(apply: Callable, diff: tuple[bool, ...] | None, xs: tuple) -> tuple[Callable, tuple]:
    """``apply`` as a function of (params, the differentiable inputs) only, with those inputs;
    ``diff`` None: every input is differentiable."""
    if diff is None:
        return apply, xs
    if len(xs) != len(diff):
        raise ValueError(f"stage takes {len(diff)} inputs, got {len(xs)}")

    def f(params, *dxs):
        it = iter(dxs)
        return apply(params, *(next(it) if d else x for d, x in zip(diff, xs, strict=True)))

    return f, tuple(x for d, x in zip(diff, xs, strict=True) if d)


def _spread(diff: tuple[bool, ...] | None, grads) -> tuple:
    """Input gradients in input order, ``None`` for the non-differentiable ones."""
    if diff is None:
        return tuple(grads)
    it = iter(grads)
    return tuple(next(it) if d else None for d in diff)


def _loss_step_fn(
    traces: collections.Counter[str],
    apply: Callable,
    diff: tuple[bool, ...] | None,
    loss: Callable,
) -> Callable:
    """The unjitted fused loss stage: forward, loss (padded rows masked out), backward and
    accumulation of the parameter gradients into ``acc`` in one kernel."""

    def loss_step(params, acc, loss_acc, labels, scale, *xs, mask=None):
        traces["loss_step"] += 1
        f, dxs = _restrict(apply, diff, xs)

        def objective(params, *dxs):
            logits = f(params, *dxs)
            per_row = loss(logits, labels)
            if mask is not None:  # padded rows: no loss, so no gradient (a select,
                # not a product, so even a non-finite loss there contributes nothing)
                keep = mask.reshape(mask.shape + (1,) * (per_row.ndim - 1))
                per_row = jnp.where(keep, per_row, jnp.zeros_like(per_row))
            return scale * jnp.sum(per_row), logits

        argnums = tuple(range(len(dxs) + 1))
        (value, logits), grads = jax.value_and_grad(objective, argnums, has_aux=True)(params, *dxs)
        return _add(acc, grads[0]), loss_acc + value, logits, _spread(diff, grads[1:])

    return loss_step


class StageKernels:
    """The jitted kernels of one stage (see module docstring)."""

    def __init__(
        self,
        model: StageModel,
        optimizer: optax.GradientTransformation,
        loss: Callable | None = None,
        *,
        differentiable: Sequence[bool] | None = None,
    ) -> None:
        self.model = model
        self.traces: collections.Counter[str] = collections.Counter()
        traces = self.traces
        apply = model.apply
        diff = tuple(differentiable) if differentiable is not None else None

        def forward(params, *xs):
            traces["forward"] += 1
            f, dxs = _restrict(apply, diff, xs)
            return jax.vjp(f, params, *dxs)

        def backward(vjp, cot, acc):
            traces["backward"] += 1
            grads = vjp(cot)
            return _add(acc, grads[0]), _spread(diff, grads[1:])

        def predict(params, *xs):
            traces["predict"] += 1
            return apply(params, *xs)

        def zeros(params):
            traces["zeros"] += 1
            return jax.tree_util.tree_map(jnp.zeros_like, params)

        def update(params, opt_state, grads):
            traces["update"] += 1
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self.forward = jax.jit(forward)
        self.backward = jax.jit(backward, donate_argnums=(2,))  # acc (module docstring)
        self.predict = jax.jit(predict)
        self.zeros = jax.jit(zeros)
        options: dict[str, Any] = {}  # (a JAX older than jit's compiler_options gets none)
        if (compiler_options := update_compiler_options()) is not None:
            options["compiler_options"] = compiler_options
        self.update = jax.jit(update, donate_argnums=(0, 1), **options)  # params, opt_state
        self.init_opt = optimizer.init
        if loss is not None:
            step = _loss_step_fn(traces, apply, diff, loss)
            self.loss_step = jax.jit(step, donate_argnums=(1,))  # acc


def owned_copy(tree):
    """A copy of every array leaf of ``tree`` on the device: what may be handed to a donating
    kernel, or handed out of the engine, without either side deleting the other's arrays."""
    return jax.tree_util.tree_map(jnp.array, tree)


def _add(acc, grads):
    """``acc + grads`` leaf by leaf: the order of summation of unfused accumulation."""
    return jax.tree_util.tree_map(jnp.add, acc, grads)
