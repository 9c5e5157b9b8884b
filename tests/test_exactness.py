"""Pipelined training equals unpipelined training and a plain-JAX full-batch reference."""

import asyncio
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from tandem.engine.kernels import binary_logistic
from tandem.engine.microbatch import group_bounds
from tandem.engine.topology import FEATURES, leader_follower, star, two_party, u_shape
from tandem.parties.split import SplitConfig
from tests.split_helpers import make_job, topologies, train_steps

TOPOLOGIES = {
    "two_party": two_party(),
    "leader_follower": leader_follower(),
    "u_shape": u_shape(),
    "star3": star(3, leader_bottom=True),
}
ROWS, STEPS = 24, 3


def reference(topo, models, params, data, labels, batches, lr):
    """Plain JAX: the whole model as one function of all parameters, full-batch SGD."""
    order = topo.topological_order()

    def loss_fn(all_params, idx):
        out = {}
        for s in order:
            xs = [jnp.asarray(data[s.owner][idx]) if i == FEATURES else out[i] for i in s.inputs]
            out[s.name] = models[s.name].apply(all_params[s.name], *xs)
        return jnp.mean(binary_logistic(out[topo.loss_stage.name], jnp.asarray(labels[idx])))

    opt = optax.sgd(lr)
    state = opt.init(params)
    for idx in batches:
        grads = jax.grad(loss_fn)(params, idx)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def run_job(topo, n_of, seed=0, chunks=1):
    cfg = SplitConfig(
        batch_size=ROWS,
        groups=1,
        optimizer="sgd",
        learning_rate=0.1,
        seed=seed,
        threshold=2,
        capacity=16,
        chunks=chunks,
    )
    parties, data, labels, models = make_job(topo, rows=ROWS, seed=seed, config=cfg)
    init = {s: p for party in parties.values() for s, p in party.params.items()}
    rng = np.random.default_rng(seed)
    batches = [rng.permutation(ROWS) for _ in range(STEPS)]
    asyncio.run(train_steps(parties, topo, batches, n_of))
    final = {s: p for party in parties.values() for s, p in party.params.items()}
    return init, final, data, labels, models, batches


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_any_group_count_matches_n1_and_plain_jax(name):
    topo = TOPOLOGIES[name]
    ns = np.random.default_rng(7).integers(1, ROWS + 1, size=STEPS)
    init, final_n1, data, labels, models, batches = run_job(topo, lambda i: 1)
    _, final_n, *_ = run_job(topo, lambda i: int(ns[i]))
    ref = reference(topo, models, init, data, labels, batches, lr=0.1)
    assert_trees_close(final_n, final_n1)
    assert_trees_close(final_n, ref)
    assert not all(
        np.allclose(np.asarray(a), np.asarray(b))
        for a, b in zip(
            jax.tree_util.tree_leaves(init), jax.tree_util.tree_leaves(final_n), strict=True
        )
    )  # it did train


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_chunked_messages_match_plain_jax(name):
    """Groups travelling in parts (the loss party computing per part) change nothing: the
    same plain-JAX reference that the n = 1 run matches (test above)."""
    topo = TOPOLOGIES[name]
    rng = np.random.default_rng(11)
    ns, chunks = rng.integers(1, 5, size=STEPS), int(rng.integers(2, 4))
    init, final, data, labels, models, batches = run_job(topo, lambda i: int(ns[i]), chunks=chunks)
    assert_trees_close(final, reference(topo, models, init, data, labels, batches, lr=0.1))


@pytest.mark.slow
@settings(max_examples=examples(4), deadline=None)
@given(
    topo=topologies(max_parties=3, max_stages=4), n=st.integers(1, ROWS), chunks=st.integers(1, 4)
)
def test_generated_topologies_match_plain_jax(topo, n, chunks):
    init, final, data, labels, models, batches = run_job(topo, lambda i: n, chunks=chunks)
    assert_trees_close(final, reference(topo, models, init, data, labels, batches, lr=0.1))


def test_equal_shaped_micro_batches_never_retrace():
    topo = leader_follower()
    parties, *_ = make_job(topo, rows=32)
    assert [hi - lo for lo, hi in group_bounds(32, 4)] == [6, 10, 10, 6]  # two shapes
    asyncio.run(train_steps(parties, topo, [np.arange(32)] * 3, lambda i: 4))
    for party in parties.values():
        for stage, kernels in party.handler.kernels.items():
            for name, count in kernels.traces.items():
                shapes = 1 if name in ("update", "zeros") else 2  # per batch vs per group
                assert count == shapes, f"{stage}.{name} traced {count} times, not {shapes}"


def test_cancelling_training_leaves_no_task_and_no_busy_thread():
    topo = two_party()

    async def main():
        parties, *_ = make_job(topo, rows=32)
        before = set(asyncio.all_tasks())
        job = asyncio.create_task(train_steps(parties, topo, [np.arange(32)] * 1000, lambda i: 8))
        await asyncio.sleep(0.3)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        assert set(asyncio.all_tasks()) - before == set()

    asyncio.run(main())
    assert not [t for t in threading.enumerate() if t.name.startswith("tandem-")]


def test_mismatched_widths_are_refused_with_a_clear_error():
    from tandem.engine.kernels import mlp_stage
    from tandem.errors import ShapeError

    topo = two_party()
    parties, *_ = make_job(topo, rows=8)
    # the follower (A) sends 3-wide activations; the leader's copy of the model expects 5
    leader = parties["B"]
    leader.handler.out_dims["bottom"] = 5
    with pytest.raises(ExceptionGroup) as info:
        asyncio.run(train_steps(parties, topo, [np.arange(8)], lambda i: 2))
    msgs = [str(e) for e in _leaves(info.value)]
    assert any(isinstance(e, ShapeError) for e in _leaves(info.value)), msgs
    assert any("expected float32[4, 5]" in m for m in msgs), msgs
    del mlp_stage


def _leaves(group):
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _leaves(e)
        else:
            yield e


def test_split_config_rejects_bad_values():
    from tandem.errors import ConfigError

    with pytest.raises(ConfigError, match="groups"):
        SplitConfig(groups=0)
    with pytest.raises(ConfigError, match="chunks"):
        SplitConfig(chunks=0)
    with pytest.raises(ConfigError, match="optimizer"):
        SplitConfig(optimizer="adagrad-ish")
    with pytest.raises(ConfigError, match="loss"):
        SplitConfig(loss="hinge?")


def test_kernels_skip_gradients_of_raw_features():
    """A stage over raw features gets the same parameter gradients without computing the
    features' gradient: its backward has one matmul fewer and returns None in its place."""
    from tandem.engine.kernels import StageKernels, mlp_stage

    model = mlp_stage([6], [5], 4)
    params = model.init(jax.random.PRNGKey(0))
    x = np.random.default_rng(0).normal(size=(3, 6)).astype(np.float32)
    cot = np.ones((3, 4), np.float32)
    full = StageKernels(model, optax.sgd(0.1))
    lean = StageKernels(model, optax.sgd(0.1), differentiable=[False])
    # each backward donates its accumulator (tandem.engine.kernels, "Donation"): a fresh one per
    # call
    g_full, in_full = full.backward(full.forward(params, x)[1], cot, full.zeros(params))
    g_lean, in_lean = lean.backward(lean.forward(params, x)[1], cot, lean.zeros(params))
    assert in_full[0].shape == x.shape and in_lean == (None,)
    assert_trees_close(g_lean, g_full)

    def matmuls(kernels):
        vjp = kernels.forward(params, x)[1]
        jaxpr = jax.make_jaxpr(lambda c: kernels.backward(vjp, c, kernels.zeros(params)))(cot)
        return str(jaxpr).count("dot_general")

    assert matmuls(lean) == matmuls(full) - 1
