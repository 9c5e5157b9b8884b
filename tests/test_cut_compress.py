"""Cut-layer compression (`tandem.parties.split.compress`): the codecs, error feedback, the
configuration and the spec, and training through each compressor."""

from __future__ import annotations

import asyncio

import ml_dtypes
import numpy as np
import pytest

from spec_helpers import open_security, small_hyper
from tandem.errors import ConfigError, FrameError, ShapeError
from tandem.parties.split.compress import KINDS, CutCompressor, from_hyper, mismatch_reasons
from tandem.transports import codec
from tandem.transports.base import Frame


def _x(rows=6, shape=(10,), seed=0):
    return np.random.default_rng(seed).normal(size=(rows, *shape)).astype(np.float32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(10,), (4, 3)])
def test_payloads_have_their_layout_and_decode_to_the_tensor_shape(kind, shape):
    c = CutCompressor(kind, 0.25)
    x = _x(5, shape)
    payload, state = c.encode(c.init(shape), x)
    arrays = payload if isinstance(payload, tuple) else (payload,)
    layout = c.layout(5, shape, "float32")
    assert [(a.dtype.name, a.shape) for a in arrays] == list(layout)
    assert c.check(arrays, shape, "float32") == []
    # the codec carries every payload array as it is (no pickle)
    back = codec.decode(codec.encode(Frame(meta={}, arrays=arrays)))
    assert [(a.dtype, a.shape) for a in back.arrays] == [(a.dtype, a.shape) for a in arrays]
    y = c.decode(back.arrays[0] if len(back.arrays) == 1 else tuple(back.arrays), shape, "float32")
    assert y.shape == x.shape and y.dtype == np.float32


def test_none_is_the_tensor_itself():
    c, x = CutCompressor(), _x()
    payload, _ = c.encode(None, x)
    assert payload is x and c.decode(payload, (10,), "float32") is x


def test_bfloat16_rounds_each_value_to_bfloat16():
    c, x = CutCompressor("bfloat16"), _x()
    payload, _ = c.encode(None, x)
    assert payload.dtype == np.dtype(ml_dtypes.bfloat16) and payload.nbytes * 2 == x.nbytes
    y = c.decode(payload, (10,), "float32")
    assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-8)


def test_int8_error_is_at_most_half_a_step_of_its_row():
    c, x = CutCompressor("int8"), _x(8, (32,))
    x[3] = 0.0  # an all-zero row has scale 0 and decodes to zeros
    (q, scale), _ = c.encode(None, x)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (8,)
    y = c.decode((q, scale), (32,), "float32")
    assert np.all(np.abs(y - x) <= scale[:, None] / 2 + 1e-7)
    assert np.all(y[3] == 0.0)


def test_topk_keeps_the_largest_magnitudes_of_each_row():
    c, x = CutCompressor("topk", 0.2), _x(4, (10,))
    (idx, values), _ = c.encode(None, x)
    assert idx.dtype == np.int32 and idx.shape == (4, 2) and values.shape == (4, 2)
    for r in range(4):
        assert set(idx[r]) == set(np.argsort(-np.abs(x[r]))[:2])
    y = c.decode((idx, values), (10,), "float32")
    np.testing.assert_array_equal(np.take_along_axis(y, idx.astype(np.int64), 1), values)
    assert np.count_nonzero(y) == 8


def test_topk_indices_outside_the_row_are_refused():
    c = CutCompressor("topk", 0.2)
    with pytest.raises(ShapeError, match="top-k indices"):
        c.decode((np.array([[0, 10]], np.int32), np.ones((1, 2), np.float32)), (10,), "float32")


@pytest.mark.parametrize("kind", ["int8", "topk"])
def test_feedback_residual_is_per_sample_and_bounded(kind):
    """Sending sample ids' gradients again and again: what arrived in total equals what was
    meant in total minus the current residual (nothing is lost), and the residual stays within
    the compressor's bound: half a step of the row for int8, at most the row for top-k."""
    c = CutCompressor(kind, 0.1)
    state = c.init((20,))
    ids = np.array([7, 2, 11])
    g = _x(3, (20,), seed=1)
    meant = np.zeros_like(g)
    got = np.zeros_like(g)
    prev = np.zeros_like(g)
    for step in range(30):
        gs = g * (1.0 + 0.1 * np.sin(step))
        payload, state = c.encode(state, gs, ids)
        meant += gs
        got += c.decode(payload, (20,), "float32")
        e = state.residual[ids]
        np.testing.assert_allclose(got + e, meant, rtol=1e-5, atol=1e-4)
        acc = gs + prev  # what was meant to travel this time
        if kind == "int8":
            assert np.all(np.abs(e) <= payload[1][:, None] / 2 + 1e-6)
        else:
            assert np.all(np.linalg.norm(e, axis=1) <= np.linalg.norm(acc, axis=1) + 1e-5)
        # bounded over time, not growing with the steps
        assert np.all(np.linalg.norm(e, axis=1) <= 10 * 1.1 * np.linalg.norm(g, axis=1))
        prev = e
    # rows of samples not sent keep a zero residual; the table grew to the largest id
    assert state.residual.shape == (12, 20) and not state.residual[[0, 1, 3]].any()
    # without ids nothing is fed back
    before = state.residual.copy()
    c.encode(state, g, None)
    np.testing.assert_array_equal(state.residual, before)


def test_unknown_values_are_config_errors_listing_the_accepted():
    from tandem.parties.split import SplitConfig

    with pytest.raises(ConfigError, match=r"'zstd'.*\['none', 'bfloat16', 'int8', 'topk'\]"):
        SplitConfig(compress="zstd")
    with pytest.raises(ConfigError, match="compress_topk"):
        SplitConfig(compress="topk", compress_topk=1.5)
    assert SplitConfig().compressor.exact


def test_spec_records_compression_only_when_set():
    spec = _two_party_spec
    exact = spec()
    assert spec(compress="none").spec_hash() == exact.spec_hash()
    int8 = spec(compress="int8")
    assert int8.hyper["compress"] == "int8" and "compress_topk" not in int8.hyper
    assert int8.spec_hash() != exact.spec_hash()
    topk = spec(compress="topk", compress_topk=0.05)
    assert from_hyper(topk.hyper) == CutCompressor("topk", 0.05)
    assert topk.spec_hash() != spec(compress="topk", compress_topk=0.1).spec_hash()


def test_validator_takes_the_compressed_layout_and_refuses_the_plain_one():
    from tandem.parties.split.negotiate import spec_validator

    spec = _two_party_spec(compress="int8")
    check = spec_validator(spec, leader="B")
    c = from_hyper(spec.hyper)
    payload, _ = c.encode(None, _x(3, (4,)))
    check(Frame(meta={}, arrays=payload, channel="act/bottom->top", sender="A"))
    with pytest.raises(FrameError, match=r"compress='int8'.*int8\[rows, 4\] \+ float32\[rows\]"):
        check(Frame(meta={}, arrays=(_x(3, (4,)),), channel="act/bottom->top", sender="A"))


def _two_party_spec(**hyper):
    from tandem.engine.topology import two_party
    from tandem.parties.split.spec import build_spec

    return build_spec(
        two_party(),
        features={"A": 3},
        samples=16,
        stage_widths={
            "bottom": {"in_dims": [3], "out_dim": 4},
            "top": {"in_dims": [4], "out_dim": 1},
        },
        hyper=small_hyper(**hyper),
        security=open_security(),
    )


def test_a_follower_stating_another_compression_refuses_naming_both_and_the_fix():
    hyper = {"compress": "int8"}
    reasons = mismatch_reasons("shop", hyper, {"compress": "bfloat16"})
    assert len(reasons) == 1
    assert "'int8'" in reasons[0] and "'bfloat16'" in reasons[0]
    assert "set compress = 'int8'" in reasons[0]
    assert mismatch_reasons("shop", hyper, {}) == []  # followers adopt the leader's
    assert mismatch_reasons("shop", {}, {"compress": "none"}) == []
    topk = mismatch_reasons(
        "shop",
        {"compress": "topk", "compress_topk": 0.1},
        {"compress": "topk", "compress_topk": 0.05},
    )
    assert len(topk) == 1 and "0.1" in topk[0] and "0.05" in topk[0]


@pytest.fixture(scope="module")
def compress_curve() -> dict:
    """``python -m bench.compress``: the exact run, then bfloat16, int8 and top-k 25 %, on the
    same data, batches and seed (as a user runs it)."""
    from run_helpers import run_bench

    out, _ = run_bench(
        "compress", "--json", "--rows", "1200", "--features", "6", "--epochs", "4",
        "--batch-size", "100", "--cut", "16", "--seed", "3",
        "--runs", "none", "bfloat16", "int8", "topk:0.25",
    )  # fmt: skip
    assert [(r["compress"], r["fraction"]) for r in out["runs"]] == [
        ("none", None), ("bfloat16", None), ("int8", None), ("topk", 0.25)
    ]  # fmt: skip
    return out


@pytest.mark.parametrize("kind", ["bfloat16", "int8", "topk"])
def test_each_compressor_trains_close_to_exact_with_fewer_bytes(compress_curve, kind):
    exact_run, *runs = compress_curve["runs"]
    [run] = [r for r in runs if r["compress"] == kind]
    ratio = exact_run["cut_bytes"] / run["cut_bytes"]
    # per value: float32 -> bfloat16 halves; int8 + a scale per row of 16; top-k 25 %: 4 of
    # 16 values, each with an int32 index
    assert ratio == pytest.approx({"bfloat16": 2.0, "int8": 64 / 20, "topk": 2.0}[kind])
    assert run["frame_bytes"] < exact_run["frame_bytes"]
    assert abs(run["test_loss"] - exact_run["test_loss"]) < 0.02, (run, exact_run)
    assert abs(run["test_auc"] - exact_run["test_auc"]) < 0.02, (run, exact_run)
    assert run["train_loss"] < 0.66  # it learned (a constant predictor scores ln 2 = 0.69)


def test_bfloat16_halves_the_bytes_of_a_real_send():
    """A bfloat16 message of a float32 cut carries half the payload bytes and, framed by the
    codec and sent over the memory transport, close to half the frame bytes."""
    from tandem.parties.split.compress import CutCompressor
    from tandem.transports.memory import MemoryNetwork

    x = _x(256, (64,))
    payload, _ = CutCompressor("bfloat16").encode(None, x)
    sizes = {}

    async def send() -> None:
        net = MemoryNetwork()
        a, b = net.endpoint("a"), net.endpoint("b")
        for name, arr in (("exact", x), ("bf16", payload)):
            before = a.sent_stats("b").bytes
            await a.send("b", "act/bottom->top", Frame(meta={"b": 0, "m": 0}, arrays=(arr,)))
            got = await b.recv("a", "act/bottom->top")
            assert got.arrays[0].dtype == arr.dtype
            sizes[name] = a.sent_stats("b").bytes - before

    asyncio.run(send())
    assert x.nbytes / payload.nbytes >= 2
    assert sizes["exact"] / sizes["bf16"] > 1.98


def test_exact_cut_bytes_count_every_float32_of_the_cut(compress_curve):
    """The party's cut counters: 900 training rows x 16 float32 each way per epoch, plus the
    300 test rows' activations of the evaluation."""
    exact_run = compress_curve["runs"][0]
    assert exact_run["cut_bytes"] == 4 * (900 * 16 * 4 * 2) + 300 * 16 * 4


def test_two_processes_over_http_train_with_the_leaders_compression(tmp_path):
    """Parties over HTTP: the follower's TOML says nothing and adopts the leader's int8 (its
    frames pass the spec's validator and the plan admission); the cut bytes shrink."""
    from tests.table_helpers import TableJob

    job = TableJob(tmp_path, ["bank", "shop"], epochs=3)
    job.cfg["bank"].setdefault("train", {})["compress"] = "int8"
    results = asyncio.run(job.run_all())
    lead, fol = results["bank"], results["shop"]
    assert not isinstance(lead, Exception), lead
    assert not isinstance(fol, Exception), fol
    assert lead["status"] == fol["status"] == "done"
    assert lead["compress"] == fol["compress"] == "int8"
    assert lead["test_accuracy"] > 0.8
    # shop's 4-wide cut: int8 values and a float32 scale per row, 8 bytes against 16
    rows = fol["cut_bytes_sent"]["bank"] // 8
    assert fol["cut_bytes_sent"]["bank"] == rows * 8 and rows > 0


def test_a_follower_toml_with_another_compression_is_refused(tmp_path):
    from tests.table_helpers import TableJob

    job = TableJob(tmp_path, ["bank", "shop"], epochs=1)
    job.cfg["bank"].setdefault("train", {})["compress"] = "bfloat16"
    job.cfg["shop"].setdefault("train", {})["compress"] = "topk"
    results = asyncio.run(job.run_all())
    text = " ".join(str(r) for r in results.values())
    assert all(isinstance(r, Exception) or r.get("status") != "done" for r in results.values())
    assert "'bfloat16'" in text and "'topk'" in text and "set compress = 'bfloat16'" in text, text


def test_party_configs_check_compression_values(tmp_path):
    from tandem.parties.split.process.party_config import PartyConfigError, load_party_config
    from tests.table_helpers import TableJob

    job = TableJob(tmp_path, ["bank", "shop"], epochs=1, data=False)
    job.cfg["bank"]["train"] = {"compress": "zstd"}
    job.cfg["shop"]["train"] = {"compress": "lz4"}
    job.write()
    for name in ("bank", "shop"):
        with pytest.raises(PartyConfigError, match=r"\[train\].*\['none', 'bfloat16', 'int8'"):
            load_party_config(job.path(name))
    job.cfg["shop"]["train"] = {"epochs": 3}  # the rest of [train] stays the leader's
    job.write()
    with pytest.raises(PartyConfigError, match="are the leader's"):
        load_party_config(job.path("shop"))


def test_bench_wan_offers_every_compressor():
    """``python -m bench.wan --compress`` accepts exactly the split package's compressors."""
    import subprocess
    import sys

    from run_helpers import ROOT

    done = subprocess.run(
        [sys.executable, "-m", "bench.wan", "--help"], cwd=ROOT, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode()
    assert f"--compress {{{','.join(KINDS)}}}" in done.stdout.decode()


@pytest.mark.parametrize("kind", ["int8", "topk"])
def test_chunked_messages_are_compressed_per_message(kind):
    """With chunks = 2 every group travels as two messages, each encoded on its own (its rows'
    feedback ids included); the job trains and both parties' counters agree with the layout."""
    from tandem.engine.topology import two_party
    from tandem.parties.split import SplitConfig
    from tests.split_helpers import make_job

    topo = two_party()
    cfg = SplitConfig(
        batch_size=24,
        groups=2,
        chunks=2,
        optimizer="sgd",
        learning_rate=0.1,
        threshold=2,
        capacity=16,
        compress=kind,
        compress_topk=0.34,
    )
    parties, *_ = make_job(topo, rows=24, config=cfg)

    async def run() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(parties["A"].serve())
            leader = parties["B"]

            async def drive() -> None:
                await leader.fit(2)
                await leader.stop()

            tg.create_task(drive())

    asyncio.run(run())
    # the bottom's 3-wide cut, 24 rows a batch, one batch an epoch, two epochs: per value
    # int8 sends 1 byte + 4 per row; top-k keeps ceil(0.34 * 3) = 2 values with their indices
    per_row = {"int8": 3 + 4, "topk": 2 * (4 + 4)}[kind]
    assert parties["A"].cut_bytes["B"] == parties["B"].cut_bytes["A"] == 2 * 24 * per_row
    feedback = parties["B"].handler.feedback["grad/bottom->top"]
    assert feedback is not None and feedback.residual.shape == (24, 3)
    assert np.abs(feedback.residual).max() > 0  # lossy: something was fed back


def test_bench_compress_curve_reports_every_run_against_exact(compress_curve):
    exact, bf16 = compress_curve["runs"][:2]
    assert exact["bytes_ratio"] == 1.0 and exact["d_auc"] == 0.0
    assert bf16["bytes_ratio"] == 2.0 and bf16["fraction"] is None
    assert bf16["frame_bytes"] < exact["frame_bytes"]
    assert bf16["d_auc"] == bf16["test_auc"] - exact["test_auc"]
