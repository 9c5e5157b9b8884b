"""The block-quantized uplink (`tandem.parties.fl.quantize`): payload layout and error bound,
the clients' error feedback (nothing lost, only delayed; a stale residual dropped), the
server's checks and refusals, its TOML keys, and, end to end, 4-bit compressed FedAdam on a
small version of ``bench.fl_compressed``'s task tracking dense round by round (run as a user
runs the benchmark)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fl_process_helpers import compression_server
from tandem.errors import ConfigError
from tandem.parties.fl import presets
from tandem.parties.fl import protocol as P
from tandem.parties.fl.client import FLClient
from tandem.parties.fl.config import FLConfigError
from tandem.parties.fl.dp import DPConfig
from tandem.parties.fl.quantize import (
    dequantize,
    levels,
    payload_size,
    quantize,
    quantize_feedback,
    split_payload,
)
from tandem.parties.fl.secagg import SecAggConfig
from tandem.parties.fl.server_process import build_fl_config
from tandem.transports.base import Frame


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(("d", "block"), [(1000, 256), (7, 3), (1, 1), (64, 64)])
def test_a_payload_has_its_size_and_every_coordinate_within_half_a_level(bits, d, block):
    x = np.random.default_rng(d + bits).normal(size=d).astype(np.float32)
    payload = quantize(x, bits, block)
    assert payload.dtype == np.uint8 and payload.shape == (payload_size(d, bits, block),)
    assert payload.size == 4 * math.ceil(d / block) + math.ceil(d * bits / 8)
    scales, codes = split_payload(payload, d, bits, block)
    assert int(codes.max()) <= 2 * levels(bits)
    per_block = np.repeat(scales, block)[:d]
    err = np.abs(dequantize(payload, d, bits, block) - x)
    assert (err <= per_block / (2 * levels(bits)) * (1 + 1e-5) + 1e-7).all()
    assert not dequantize(quantize(np.zeros(d, np.float32), bits, block), d, bits, block).any()


def test_error_feedback_loses_nothing_it_only_delays():
    """A coordinate below half a level is never sent without feedback; with it, what was sent
    over rounds plus the residual is what was trained, and it does get through."""
    d, rounds = 512, 40
    delta = np.full(d, 0.02, np.float32)
    delta[0] = 1.0  # the block's scale: every other entry rounds to 0 at 2 bits
    sent_plain = sum(dequantize(quantize(delta, 2, 256), d, 2, 256) for _ in range(rounds))
    assert sent_plain[1] == 0.0  # no feedback: the small coordinates never move
    residual, sent = None, np.zeros(d, np.float32)
    for _ in range(rounds):
        payload, residual = quantize_feedback(delta, residual, 2, 256)
        sent += dequantize(payload, d, 2, 256)
    np.testing.assert_allclose(sent + residual, rounds * delta, rtol=1e-4, atol=1e-5)
    assert sent[1] > 0 and np.abs(residual).max() <= 1.0


def _client(d: int) -> FLClient:
    class _T:
        init_vec = np.zeros(d, np.float32)

    return FLClient(None, "server", np.zeros((1, 1)), np.zeros(1), _T())  # type: ignore[arg-type]


def test_a_client_drops_its_residual_after_missing_more_than_max_gap_rounds():
    d = 256
    up = {"kind": "quant", "bits": 2, "block": 256, "max_gap": 2}
    delta = np.full(d, 1e-3, np.float32)
    delta[0] = 1.0
    c = _client(d)
    c._quantize(0, delta, up)
    kept = c.feedback[2].copy()
    assert np.abs(kept[1:]).min() > 0
    c._quantize(2, delta, up)  # two rounds later: within max_gap, the residual is added
    np.testing.assert_allclose(c.feedback[2][1:], 2 * kept[1:], rtol=1e-5)
    c._quantize(5, delta, up)  # three rounds later: dropped, starts afresh
    np.testing.assert_allclose(c.feedback[2], kept, rtol=1e-6)
    c._quantize(6, delta, {**up, "bits": 4})  # another uplink setting: dropped too
    np.testing.assert_allclose(c.feedback[2], quantize_feedback(delta, None, 4, 256)[1])


def _update(payload: np.ndarray, kind: str = "quant") -> Frame:
    return Frame(meta={"round": 0, "n": 3, "version": 0, "kind": kind}, arrays=(payload,))


def test_the_server_refuses_a_bad_quantized_payload_naming_it():
    d, up = 100, {"kind": "quant", "bits": 2, "block": 64, "max_gap": 1}
    good = quantize(np.ones(d, np.float32), 2, 64)
    kw = dict(uplink=up, d=d, version=0, max_bytes=10_000)
    assert P.check_update(_update(good), **kw)[3].dtype == np.uint8
    with pytest.raises(P.UpdateError, match="must be uint8"):
        P.check_update(_update(good.astype(np.float32)), **kw)
    with pytest.raises(P.UpdateError, match="must be uint8"):
        P.check_update(_update(good[:-1]), **kw)
    nan = good.copy()
    nan[:4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    with pytest.raises(P.UpdateError, match="NaN or Inf block scales"):
        P.check_update(_update(nan), **kw)
    high = good.copy()
    high[-1] = 0xFF  # code 3 > 2L = 2 at 2 bits
    with pytest.raises(P.UpdateError, match="code above 2"):
        P.check_update(_update(high), **kw)
    for bad in ({**up, "bits": 3}, {**up, "block": 0}, {**up, "max_gap": -1}):
        with pytest.raises(ConfigError, match="quantized uplink"):
            P.check_uplink(bad, d)


def test_a_quantized_uplink_with_secure_aggregation_or_dp_is_refused_naming_why():
    with pytest.raises(ConfigError, match=r"uplink_bits.*\[secagg\].*own block scales"):
        presets.compressed(1000, uplink_bits=4, secagg=SecAggConfig())
    with pytest.raises(ConfigError, match=r"uplink_bits.*\[dp\]"):
        presets.compressed(1000, uplink_bits=4, dp=DPConfig())


def test_toml_uplink_bits_builds_a_quantized_uplink_and_refuses_what_does_not_apply(tmp_path):
    cfg = compression_server(tmp_path, {"preset": "compressed", "uplink_bits": 4})
    fl = build_fl_config(cfg, 10_000)
    assert fl.uplink == {"kind": "quant", "bits": 4, "block": 256, "max_gap": 3}
    assert fl.rule.topk is None  # the server applies every coordinate
    randk = build_fl_config(compression_server(tmp_path, {"preset": "compressed"}), 10_000)
    assert randk.uplink == {"kind": "randk", "k": 10_000 // 60}
    with pytest.raises(FLConfigError, match="uplink_bits must be 0"):
        compression_server(tmp_path, {"preset": "compressed", "uplink_bits": 3})
    with pytest.raises(FLConfigError, match=r"\['topk_ratio'\] do not apply with uplink_bits"):
        compression_server(tmp_path, {"preset": "compressed", "uplink_bits": 4, "topk_ratio": 10})
    with pytest.raises(FLConfigError, match='apply to preset = "compressed" only'):
        compression_server(tmp_path, {"uplink_bits": 4})


def test_four_bit_uplink_tracks_dense_round_by_round_on_the_user_like_task():
    """Small version of the task (MLP 28-512-2, 6 rounds, no warm-up): every round within 0.5
    points of dense FL while the uplink carries 7x fewer bytes."""
    from run_helpers import run_bench

    out, _ = run_bench(
        "fl_compressed", "--json", "--rows", "1000", "--test-rows", "1200", "--hidden", "512",
        "--rounds", "6", "--seed", "0", "--warmup-rounds", "0", "--ramp-rounds", "0",
        "--uplink-bits", "4",
    )  # fmt: skip
    assert out["compressed_warmup"] is None and out["compressed_rounds"] == 6
    gaps = [a - b for a, b in out["compressed_curve"].values()]
    # 6 test rows of 1,200 (accuracies are multiples of 1/12 %, reported to 2 decimals)
    assert len(gaps) == 6 and max(gaps) <= 0.5 + 0.01, gaps
    assert out["compressed_uplink_ratio"] >= 7.01  # rounded to 2 decimals: above 7 unrounded


def test_the_server_bounds_a_quantized_update_by_its_payload_size():
    from fl_helpers import small_setup
    from tandem.parties.fl.server import FLServer
    from tandem.transports.memory import MemoryNetwork

    _, trainer = small_setup()
    d = trainer.dim
    cfg = presets.compressed(d, uplink_bits=4, rounds=1)
    server = FLServer(MemoryNetwork().endpoint("server"), ["c0"], trainer, cfg)
    size = payload_size(d, 4, 256)
    assert size < server.max_update_bytes <= size + size // 64 + 4096


async def test_quantized_rounds_over_http_deflated():
    """The uint8 payload crosses the real HTTP transport, deflated, and every client's update
    is accepted; its bytes stay below a fifth of a float32 update."""
    from fl_helpers import small_setup
    from tandem.parties.fl.federation import run_http_federation

    data, trainer = small_setup()
    cfg = presets.compressed(
        trainer.dim, uplink_bits=4, rounds=2, fraction=1.0, round_timeout=20.0, lossless=True
    )
    server = await run_http_federation(data, trainer, cfg, secret=b"fl-test-secret")
    assert [r.accepted for r in server.reports] == [["c0", "c1", "c2", "c3"]] * 2
    assert all(r.up_bytes < 4 * 4 * trainer.dim / 5 for r in server.reports)
