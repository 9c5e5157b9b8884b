"""Cut tensors of any float dtype (float32, bfloat16, float16) and any rank, end to end: the
codec, the stage contract, training (n = 1 vs n = 4 and a plain-JAX reference), the negotiated
spec and its validator, the receiver's check, export and cross-party inference."""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from spec_helpers import open_security, small_hyper
from tandem.engine.kernels import StageModel, binary_logistic, derive_stage
from tandem.engine.topology import two_party
from tandem.errors import ConfigError, FrameError, ShapeError
from tandem.parties.models import from_functions, load_factory
from tandem.parties.split import SplitConfig, SplitParty, inference
from tandem.parties.split.negotiate import spec_validator
from tandem.parties.split.spec import TaskSpec, build_spec
from tandem.transports import codec
from tandem.transports.base import Frame
from tandem.transports.memory import MemoryNetwork
from tests.cut_models import bottom, top

FEATS, ROWS, STEPS, LR = 5, 16, 4, 0.5
#: (shape after the rows, dtype, tolerance of the comparisons: the cut dtype's epsilon, one
#: rounding of an activation; the runs differ from each other only by float32 reassociation)
CUTS = {
    "bfloat16-rank3": ((4, 4), "bfloat16", float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps)),
    "float16-rank2": ((6,), "float16", float(np.finfo(np.float16).eps)),
}


def models_for(shape, dtype):
    return {"bottom": bottom(FEATS, shape, dtype), "top": top(shape, dtype)}


def make_parties(models_a, models_b, *, seed=0, net=None):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, FEATS)).astype(np.float32)
    y = (rng.random(ROWS) > 0.5).astype(np.float32)
    net = net or MemoryNetwork()
    cfg = SplitConfig(batch_size=ROWS, groups=1, optimizer="sgd", learning_rate=LR, seed=seed)
    topo = two_party()
    a = SplitParty("A", topo, models_a, net.endpoint("A"), datasets={"train": x}, config=cfg)
    b = SplitParty("B", topo, models_b, net.endpoint("B"), labels={"train": y}, config=cfg)
    return a, b, x, y


async def train(a, b, batches, n):
    async with asyncio.TaskGroup() as tg:
        tg.create_task(a.serve())
        for idx in batches:
            await b.run_batch(idx, n=n)
        await b.stop()


def reference(models, params, x, y, batches):
    """Plain JAX: bottom then top as one function, full-batch SGD."""

    def loss_fn(p, idx):
        z = models["bottom"].apply(p["bottom"], jnp.asarray(x[idx]))
        logits = models["top"].apply(p["top"], z)
        return jnp.mean(binary_logistic(logits, jnp.asarray(y[idx])))

    opt = optax.sgd(LR)
    state = opt.init(params)
    for idx in batches:
        updates, state = opt.update(jax.grad(loss_fn)(params, idx), state, params)
        params = optax.apply_updates(params, updates)
    return params


def run(shape, dtype, n, record=None, models=None):
    models = models or models_for(shape, dtype)
    a, b, x, y = make_parties(models, models)
    init = {**a.params, **b.params}
    if record is not None:
        for party in (a, b):
            real = party.handler.receive

            def receive(op, array, real=real):
                record.append((op.channel, array.dtype.name, array.shape))
                real(op, array)

            party.handler.receive = receive
    rng = np.random.default_rng(1)
    batches = [rng.permutation(ROWS) for _ in range(STEPS)]
    asyncio.run(train(a, b, batches, n))
    return init, {**a.params, **b.params}, models, x, y, batches


def assert_close(p, q, tol):
    for u, v in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol)


# -- the wire and the contract ---------------------------------------------------------------------
def test_codec_carries_bfloat16_and_float16_of_any_rank():
    bf = (np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7).astype(ml_dtypes.bfloat16)
    f16 = np.linspace(-1, 1, 6, dtype=np.float16).reshape(3, 2)
    raw = codec.encode(Frame(arrays=(bf, f16)))
    back = codec.decode(raw)
    assert [a.dtype for a in back.arrays] == [bf.dtype, f16.dtype]
    assert back.arrays[0].shape == (2, 3, 4)
    assert back.arrays[0].tobytes() == bf.tobytes() and back.arrays[1].tobytes() == f16.tobytes()
    assert codec.header_of(Frame(arrays=(bf,)))["arrays"][0]["dtype"] == "bfloat16"
    assert codec.encoded_size(Frame(arrays=(bf,))) == len(codec.encode(Frame(arrays=(bf,))))
    void = raw.replace(b'"bfloat16"', b'"<V2"     ')  # same length: only the dtype differs
    with pytest.raises(FrameError, match="not allowed on the wire"):
        codec.decode(void)


def test_stage_outputs_are_derived_and_checked():
    m = bottom(FEATS, (4, 4), "bfloat16")
    assert (m.out_shape, m.out_dtype, m.out_dim, m.in_dims) == ((4, 4), "bfloat16", 16, (FEATS,))
    t = top((4, 4), "bfloat16")
    assert (t.in_dims, t.out_shape, t.out_dtype) == ((16,), (1,), "float32")
    plain = StageModel(m.init, m.apply, (FEATS,), 16)  # the defaults: a float32 matrix
    assert (plain.out_shape, plain.out_dtype) == ((16,), "float32")
    with pytest.raises(ConfigError, match="out_dim is the flat width"):
        StageModel(m.init, m.apply, (FEATS,), 15, out_shape=(4, 4))
    with pytest.raises(ConfigError, match="not a cut dtype"):
        StageModel(m.init, m.apply, (FEATS,), 16, out_dtype="int8")
    with pytest.raises(ConfigError, match="not a cut dtype"):
        derive_stage(m.init, lambda p, x: m.apply(p, x).astype(jnp.int32), [FEATS])
    with pytest.raises(ConfigError, match=r"one \[rows, \.\.\.\] array"):
        derive_stage(m.init, lambda p, x: m.apply(p, x).sum(), [FEATS])


# -- training --------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CUTS))
def test_training_matches_n1_and_plain_jax(case):
    shape, dtype, tol = CUTS[case]
    seen: list = []
    init, final_n1, models, x, y, batches = run(shape, dtype, 1, record=seen)
    _, final_n4, *_ = run(shape, dtype, 4)
    assert_close(final_n4, final_n1, tol)
    assert_close(final_n1, reference(models, init, x, y, batches), tol)
    moved = [
        float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
        for u, v in zip(
            jax.tree_util.tree_leaves(init), jax.tree_util.tree_leaves(final_n1), strict=True
        )
    ]
    assert min(moved) > tol and max(moved) > 10 * tol  # every leaf trained, past the tolerance
    # activations and their gradients crossed the wire in the cut's dtype and shape
    assert {(ch, dt, s[1:]) for ch, dt, s in seen} == {
        ("act/bottom->top", dtype, shape),
        ("grad/bottom->top", dtype, shape),
    }
    for leaf in jax.tree_util.tree_leaves(final_n1):
        assert np.asarray(leaf).dtype == np.float32  # parameters and their updates stay float32


def adapted_models(shape, dtype):
    """An Equinox bottom and a Flax linen top whose cut is ``dtype[rows, *shape]``, built by
    their factories (so an export names them)."""
    kw = {"shape": list(shape), "dtype": dtype}
    return {
        "bottom": load_factory("tests.cut_models:equinox_bottom", {"features": FEATS, **kw}),
        "top": load_factory("tests.cut_models:linen_top", kw),
    }


async def test_a_float16_cut_through_the_equinox_and_flax_adapters(tmp_path):
    """The adapters read the cut from the module (float16 [rows, 3, 2]); training gives n = 4
    what it gives n = 1 and what plain JAX gives, the cut crossing in its dtype and shape; an
    export serves the in-process model's predictions."""
    shape, dtype = (3, 2), "float16"
    tol = float(np.finfo(np.float16).eps)
    models = adapted_models(shape, dtype)
    assert (models["bottom"].out_shape, models["bottom"].out_dtype) == (shape, dtype)
    assert (models["bottom"].out_dim, models["top"].in_dims) == (6, (6,))
    seen: list = []
    init, final_n1, _, x, y, batches = await asyncio.to_thread(run, shape, dtype, 1, seen, models)
    _, final_n4, *_ = await asyncio.to_thread(run, shape, dtype, 4, None, models)
    assert_close(final_n4, final_n1, tol)
    assert_close(final_n1, reference(models, init, x, y, batches), tol)
    assert (
        max(
            float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
            for u, v in zip(
                jax.tree_util.tree_leaves(init), jax.tree_util.tree_leaves(final_n1), strict=True
            )
        )
        > 10 * tol
    )
    assert {(ch, dt, s[1:]) for ch, dt, s in seen} == {
        ("act/bottom->top", dtype, shape),
        ("grad/bottom->top", dtype, shape),
    }

    a, b, *_ = make_parties(models, models)
    new = np.random.default_rng(6).normal(size=(9, FEATS)).astype(np.float32)
    a.datasets["new"] = new
    async with asyncio.TaskGroup() as tg:
        tg.create_task(a.serve())
        await b.fit(2)
        ref = await b.predict("new", len(new), batch_size=4)
        await b.stop()
    for p in (a, b):
        desc = await inference.export_party(p, tmp_path / f"{p.name}.safetensors")
        assert desc["cuts"] == {"bottom": {"shape": list(shape), "dtype": dtype}}
    am = await inference.load_model(tmp_path, "A")
    bm = await inference.load_model(tmp_path, "B")
    assert am.models["bottom"].spec["factory"] == "tests.cut_models:equinox_bottom"
    net = MemoryNetwork()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(inference.serve(net.endpoint("A"), am, new))
        out = await inference.predict(net.endpoint("B"), bm, rows=len(new), batch_size=4)
    np.testing.assert_array_equal(out.outputs, ref)


def test_float16_parameters_with_adam_are_refused():
    """Adam's epsilon (1e-8) rounds to 0 in float16, so a zero gradient (a dead ReLU, a
    padded row) makes its update 0 / 0: NaN parameters. A float16 cut (cast inside apply)
    with float32 parameters, or float16 parameters with sgd, train."""

    def init(key):
        return {"w": jax.random.normal(key, (FEATS, 2)).astype(jnp.float16)}

    half = from_functions(init, lambda p, x: x.astype(jnp.float16) @ p["w"], [FEATS])
    models = {
        "bottom": half,
        "top": from_functions(init, lambda p, z: z @ p["w"][:2, :1], [(((2,), "float16"))]),
    }
    x = np.zeros((ROWS, FEATS), np.float32)
    for optimizer in ("adam", "adamw"):
        with pytest.raises(ConfigError, match=r"stage 'bottom'.*float16.*adam"):
            SplitParty(
                "A",
                two_party(),
                models,
                MemoryNetwork().endpoint("A"),
                datasets={"train": x},
                config=SplitConfig(optimizer=optimizer),
            )
    SplitParty(
        "A",
        two_party(),
        models,
        MemoryNetwork().endpoint("A"),
        datasets={"train": x},
        config=SplitConfig(optimizer="sgd"),
    )


def test_adapters_take_shaped_inputs_and_check_the_output():
    """``in_dims`` entries may be ``(shape, dtype)``; the output's rank and dtype are read, and
    a dtype that cannot cross a cut is refused naming the adapter."""
    shape = (4, 8)

    def init(key):
        return {"w": jnp.ones((32, 2))}

    def apply(p, z):
        return (z.reshape(z.shape[0], -1).astype(jnp.float32) @ p["w"]).astype(jnp.bfloat16)

    m = from_functions(init, apply, [(shape, "bfloat16")])
    assert (m.in_dims, m.out_shape, m.out_dtype, m.out_dim) == ((32,), (2,), "bfloat16", 2)
    with pytest.raises(ConfigError, match=r"from_functions: apply\(init\(key\), \*inputs\) fails"):
        from_functions(init, apply, [(shape[::-1], "float16"), 3])
    with pytest.raises(ConfigError, match="from_functions: out_dtype 'int32' is not a cut dtype"):
        from_functions(init, lambda p, z: apply(p, z).astype(jnp.int32), [(shape, "bfloat16")])
    with pytest.raises(ConfigError, match=r"out_dim is 3 but apply returns \[4, 8\] per row"):
        from_functions(init, lambda p, z: z, [(shape, "bfloat16")], 3)
    with pytest.raises(ConfigError, match="in_dims .*give a width"):
        from_functions(init, apply, [((4, 8), "int8")])


@pytest.mark.parametrize(
    ("theirs", "field"),
    [(((4, 4), "float16"), "dtype"), (((2, 8), "bfloat16"), "shape")],
    ids=["dtype", "shape"],
)
def test_a_cut_of_another_dtype_or_shape_is_refused_naming_the_field(theirs, field):
    """A sends bfloat16[rows, 4, 4]; B's model of A's bottom declares another dtype or shape."""
    mine = models_for((4, 4), "bfloat16")
    other = {"bottom": bottom(FEATS, *theirs), "top": top(*theirs)}
    a, b, *_ = make_parties(mine, other)
    with pytest.raises(ExceptionGroup) as info:
        asyncio.run(train(a, b, [np.arange(ROWS)], 2))
    errors = [e for e in _leaves(info.value) if isinstance(e, ShapeError)]
    assert errors, info.value
    msg = str(errors[0])
    want = f"{theirs[1]}[8, {', '.join(map(str, theirs[0]))}]"
    assert "received bfloat16[8, 4, 4] on 'act/bottom->top'" in msg, msg
    assert f"expected {want}" in msg and f"its {field} differs" in msg, msg


def _leaves(group):
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _leaves(e)
        else:
            yield e


# -- the negotiated spec ---------------------------------------------------------------------------
HYPER = small_hyper(threshold=1, capacity=2)
SECURITY = open_security(reject_nonfinite=True)


def spec_with(bottom_widths):
    return build_spec(
        two_party(),
        features={"A": FEATS},
        samples=ROWS,
        stage_widths={"bottom": bottom_widths, "top": {"in_dims": [16], "out_dim": 1}},
        hyper=HYPER,
        security=SECURITY,
    )


def test_spec_records_shape_and_dtype_and_the_validator_names_the_field():
    cut = {"in_dims": [FEATS], "out_dim": 16, "out_shape": [4, 4], "out_dtype": "bfloat16"}
    spec = spec_with(cut)
    assert spec.stages["bottom"]["out_shape"] == [4, 4]
    assert spec.stages["bottom"]["out_dtype"] == "bfloat16"
    assert spec.edges[0]["dtype"] == "bfloat16" and spec.edges[0]["shape"] == [4, 4]
    assert TaskSpec.from_json(spec.canonical()).spec_hash() == spec.spec_hash()
    assert spec.channel_shapes()["grad/bottom->top"] == ("bfloat16", (4, 4))
    # the defaults (a float32 matrix) record nothing new: such specs hash as before
    plain = spec_with({"in_dims": [FEATS], "out_dim": 16})
    explicit = spec_with({**plain.stages["bottom"], "out_shape": [16], "out_dtype": "float32"})
    assert explicit.spec_hash() == plain.spec_hash()
    assert "out_shape" not in plain.stages["bottom"] and "shape" not in plain.edges[0]

    validate = spec_validator(spec, leader="B")
    ok = np.zeros((3, 4, 4), ml_dtypes.bfloat16)
    validate(Frame(sender="A", channel="act/bottom->top", arrays=(ok,)))
    validate(Frame(sender="B", channel="grad/bottom->top", arrays=(ok,)))
    cases = {
        "dtype": ok.astype(np.float32),
        "shape": np.zeros((3, 16), ml_dtypes.bfloat16),
        "rows": np.zeros((9, 4, 4), ml_dtypes.bfloat16),
    }
    for field, bad in cases.items():
        with pytest.raises(FrameError, match=rf"bfloat16\[rows, 4, 4\].*its {field} differs"):
            validate(Frame(sender="A", channel="act/bottom->top", arrays=(bad,)))
    nan = ok.copy()
    nan[1, 2, 3] = np.nan
    with pytest.raises(FrameError, match="NaN or Inf"):
        validate(Frame(sender="A", channel="act/bottom->top", arrays=(nan,)))


def test_a_party_refuses_a_spec_with_another_cut():
    spec = spec_with({"in_dims": [FEATS], "out_dim": 16, "out_shape": [4, 4]})  # float32
    mine = {"bottom": {"in_dims": [FEATS], "out_dim": 16, "out_shape": [4, 4]}}
    reasons = spec.check_local(
        "A", features=FEATS, samples=ROWS, stages={"bottom": {**mine["bottom"]}}
    )
    assert reasons == []
    mine["bottom"]["out_dtype"] = "bfloat16"
    reasons = spec.check_local("A", features=FEATS, samples=ROWS, stages=mine)
    assert reasons == [
        "stage 'bottom': 'A' has out_dtype bfloat16 but the spec says float32; the cut tensor "
        "must have the same shape and dtype on both sides"
    ]
    mine["bottom"].update(out_shape=[2, 8], out_dtype="float32")
    (reason,) = spec.check_local("A", features=FEATS, samples=ROWS, stages=mine)
    assert "has out_shape [2, 8] but the spec says [4, 4]" in reason
    with pytest.raises(ConfigError, match="out_dtype 'float64' is not a cut dtype"):
        spec_with({"in_dims": [FEATS], "out_dim": 16, "out_dtype": "float64"})
    with pytest.raises(ConfigError, match="whose product is its out_dim 16"):
        spec_with({"in_dims": [FEATS], "out_dim": 16, "out_shape": [4, 5]})


# -- export and cross-party inference --------------------------------------------------------------
async def test_export_and_inference_reproduce_in_process_predictions(tmp_path):
    shape, dtype, _ = CUTS["bfloat16-rank3"]
    models = models_for(shape, dtype)
    a, b, *_ = make_parties(models, models)
    new = np.random.default_rng(5).normal(size=(11, FEATS)).astype(np.float32)
    a.datasets["new"] = new
    async with asyncio.TaskGroup() as tg:
        tg.create_task(a.serve())
        await b.fit(2)
        ref = await b.predict("new", len(new), batch_size=4)
        await b.stop()
    for p in (a, b):
        desc = await inference.export_party(p, tmp_path / f"{p.name}.safetensors")
        assert desc["cuts"] == {"bottom": {"shape": [4, 4], "dtype": "bfloat16"}}
    am = await inference.load_model(tmp_path, "A")
    bm = await inference.load_model(tmp_path, "B")
    assert bm.models["bottom"].out_shape == (4, 4) and bm.models["bottom"].out_dtype == dtype
    spec = inference.inference_spec(bm, rows=len(new), batch_size=4)
    assert spec.edges[0]["dtype"] == dtype and spec.edges[0]["shape"] == [4, 4]
    net = MemoryNetwork()
    async with asyncio.TaskGroup() as tg:
        served = tg.create_task(inference.serve(net.endpoint("A"), am, new))
        out = await inference.predict(net.endpoint("B"), bm, rows=len(new), batch_size=4)
    assert served.result() == 3
    np.testing.assert_array_equal(out.outputs, ref)


async def test_inference_refuses_an_export_with_another_cut(tmp_path):
    shape, dtype, _ = CUTS["bfloat16-rank3"]
    models = models_for(shape, dtype)
    a, b, *_ = make_parties(models, models)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(a.serve())
        await b.fit(1)
        await b.stop()
    for p in (a, b):
        await inference.export_party(p, tmp_path / f"{p.name}.safetensors")
    am = await inference.load_model(tmp_path, "A")
    bm = await inference.load_model(tmp_path, "B")
    spec = inference.inference_spec(bm, rows=4)
    assert inference.inference_check(am, rows=4)(spec) == []
    forged = dict(spec.to_dict())
    forged["stages"] = {**spec.stages, "bottom": {**spec.stages["bottom"], "out_dtype": "float16"}}
    (reason,) = inference.inference_check(am, rows=4)(TaskSpec.from_dict(forged))
    assert reason == (
        "stage 'bottom' outputs float16[rows, 4, 4] in the leader's export but "
        "bfloat16[rows, 4, 4] in the export of 'A'"
    )


async def test_http_carries_a_bfloat16_cut_and_refuses_another(http_pair):
    """Over HTTP, with the spec's validator installed on the receiver: a bfloat16[rows, 4, 4]
    activation arrives bit for bit; a float32 one, or one holding NaN, is refused."""
    from tandem.transports.http import HttpConfig

    def config(name, **kw):
        return HttpConfig(name=name, secret=b"k" * 32, retry_timeout=0.5, **kw)

    spec = spec_with(
        {"in_dims": [FEATS], "out_dim": 16, "out_shape": [4, 4], "out_dtype": "bfloat16"}
    )
    validate = spec_validator(spec, leader="B")
    a, b = await http_pair(config, names=("A", "B"), b_kw={"validator": validate})
    cut = (np.arange(48, dtype=np.float32).reshape(3, 4, 4) / 9).astype(ml_dtypes.bfloat16)
    await a.send("B", "act/bottom->top", Frame(arrays=(cut,)))
    got = (await b.recv("A", "act/bottom->top")).arrays[0]
    assert got.dtype == cut.dtype and got.shape == cut.shape and got.tobytes() == cut.tobytes()
    with pytest.raises(FrameError, match="its dtype differs"):
        await a.send("B", "act/bottom->top", Frame(arrays=(cut.astype(np.float32),)))
    nan = cut.copy()
    nan[0, 0, 0] = np.nan
    with pytest.raises(FrameError, match="NaN or Inf"):
        await a.send("B", "act/bottom->top", Frame(arrays=(nan,)))


# -- the receiver's NaN/Inf check covers the 16-bit floats ----------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_all_finite_of_16_bit_floats_agrees_with_isfinite(dtype):
    """Bit test of `scan.all_finite` against ``np.isfinite(a).all()``: NaN and Inf of both signs
    anywhere (first, last, across a piece boundary of the test), and the largest finite values,
    which must pass."""
    from tandem.transports.http.scan import _BITS_STEP, all_finite, is_float

    dt = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    assert is_float(dt)
    n = 2 * _BITS_STEP + 5
    big = np.full(n, ml_dtypes.finfo(dt).max, dt)
    big[::2] = -big[::2]
    cases = [np.zeros(n, dt), big, np.zeros(1, dt)]
    for bad in (np.nan, np.inf, -np.inf):
        for pos in (0, _BITS_STEP - 1, _BITS_STEP, n - 1):
            a = np.ones(n, dt)
            a[pos] = bad
            cases.append(a)
    for a in cases:
        assert all_finite(a.reshape(-1, 1)) == bool(np.isfinite(a.astype(np.float32)).all())


async def test_http_receiver_refuses_a_bfloat16_nan_without_a_validator(http_pair):
    """The transport's own check (no spec validator installed): a bfloat16 tensor holding
    NaN is refused (422), in a small frame and in one large enough to be scanned while its
    body arrives; finite ones arrive bit for bit."""
    from tandem.transports.http import HttpConfig

    def config(name, **kw):
        return HttpConfig(name=name, secret=b"k" * 32, retry_timeout=0.5, **kw)

    a, b = await http_pair(config, names=("A", "B"))
    for rows in (3, 1 << 16):  # 96 bytes; 2 MiB
        cut = (np.arange(rows * 16, dtype=np.float32).reshape(rows, 4, 4) % 7).astype(
            ml_dtypes.bfloat16
        )
        await a.send("B", "c", Frame(arrays=(cut,)))
        assert (await b.recv("A", "c")).arrays[0].tobytes() == cut.tobytes()
        bad = cut.copy()
        bad[-1, 3, 3] = np.nan
        with pytest.raises(FrameError, match="NaN or Inf"):
            await a.send("B", "c", Frame(arrays=(bad,)))
    assert b.refused == {"nonfinite": 2}
