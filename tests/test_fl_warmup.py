"""The compression ramp (`tandem.parties.fl.warmup`): dense rounds first, then geometrically
sparser rounds down to the configured compression; its TOML keys; and, end to end, compressed
FedAdam on a small version of the user-like task (`tandem.parties.fl.synthetic`) reaching
dense, run as a user runs ``bench.fl_compressed``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fl_process_helpers import compression_server
from tandem.errors import ConfigError
from tandem.parties.fl.config import FLConfigError
from tandem.parties.fl.server_process import build_fl_config
from tandem.parties.fl.synthetic import SEGMENTS, make_client_table, make_task
from tandem.parties.fl.warmup import Warmup, round_compression

D = 60_000
RANDK = {"kind": "randk", "k": D // 60}


def test_density_is_dense_then_ramps_geometrically_then_stays_at_the_floor():
    w = Warmup(2, 2)
    got = [w.density(r, 1 / 64) for r in range(6)]
    assert got[:2] == [1.0, 1.0]
    assert got[2:4] == pytest.approx([64 ** (-1 / 3), 64 ** (-2 / 3)])  # 1/4, 1/16
    assert got[4:] == [1 / 64, 1 / 64]
    assert [Warmup(0, 0).density(r, 0.1) for r in range(3)] == [0.1] * 3


def test_round_compression_is_dense_first_and_never_sparser_than_configured():
    w = Warmup(1, 3)
    settings = [round_compression(w, r, RANDK, D // 50, D) for r in range(8)]
    assert settings[0] == ({"kind": "dense"}, None)
    ks = [up["k"] for up, _ in settings[1:]]
    tops = [t for _, t in settings[1:]]
    assert ks == sorted(ks, reverse=True) and tops == sorted(tops, reverse=True)
    assert min(ks) == RANDK["k"] and min(tops) == D // 50  # the floor, never below
    assert settings[-1] == (RANDK, D // 50)
    assert round_compression(None, 0, RANDK, 7, D) == (RANDK, 7)  # off: as configured


def test_a_sketch_ramps_by_its_columns_and_dense_stays_dense():
    sketch = {"kind": "sketch", "rows": 5, "cols": 200}
    up, top = round_compression(Warmup(0, 1), 0, sketch, None, D)
    assert up["rows"] == 5 and up["cols"] > 200 and top is None
    assert round_compression(Warmup(), 9, sketch, None, D) == (sketch, None)
    assert round_compression(Warmup(), 0, {"kind": "dense"}, None, D) == ({"kind": "dense"}, None)


def test_negative_rounds_are_refused_by_name():
    with pytest.raises(ConfigError, match="compression.warmup_rounds"):
        Warmup(-1, 0)


def test_toml_compressed_preset_starts_dense_by_default_and_can_turn_it_off(tmp_path):
    cfg = compression_server(tmp_path, {"preset": "compressed"})
    assert build_fl_config(cfg, D).warmup == Warmup(2, 4)
    off = {"preset": "compressed", "warmup_rounds": 0, "ramp_rounds": 0}
    assert build_fl_config(compression_server(tmp_path, off), D).warmup is None
    assert build_fl_config(compression_server(tmp_path, {}), D).warmup is None  # dense preset
    with pytest.raises(FLConfigError, match='apply to preset = "compressed" only'):
        compression_server(tmp_path, {"warmup_rounds": 3})
    with pytest.raises(FLConfigError, match=r"compression\.ramp_rounds"):
        compression_server(tmp_path, {"preset": "compressed", "ramp_rounds": -1})


SMALL = dict(clients=6, rows=1000, test_rows=1200, seed=0)


def test_the_user_like_task_is_seeded_non_iid_and_mixes_both_column_kinds():
    t = make_client_table(50, 0, alpha=0.5, shift=0.6, seed=0)
    assert t.numeric.shape == (50, 20) and t.segment.dtype.kind == "U"
    assert set(t.segment) <= set(SEGMENTS)
    a, b = make_task(**SMALL), make_task(**SMALL)
    assert all(np.array_equal(x, y) for (x, _), (y, _) in zip(a.clients, b.clients, strict=True))
    rates = [float(y.mean()) for _, y in a.clients]
    assert max(rates) - min(rates) > 0.3  # label skew from the shifted clients
    assert a.num_features == 28 and a.num_classes == 2


def test_warm_up_rounds_are_dense_rounds_and_compressed_stays_near_dense():
    """The small version of the task (MLP 28-512-2, 8 rounds): the warm-up rounds are dense
    FL's rounds exactly, every later round stays within 3.5 points of dense while carrying
    1/20 of its uplink or less by the end; compressed from round one starts far below."""
    from run_helpers import run_bench

    out, _ = run_bench(
        "fl_compressed", "--json", "--rows", "1000", "--test-rows", "1200", "--hidden", "512",
        "--rounds", "8", "--seed", "0", "--baseline",
    )  # fmt: skip
    assert out["compressed_warmup"] == dataclasses.asdict(Warmup())
    acc, up = list(out["compressed_curve"].values()), list(out["compressed_up_bytes"].values())
    assert len(acc) == len(up) == 8
    for r in range(2):
        assert acc[r][0] == acc[r][1]
        assert up[r][0] == up[r][1]
    gaps = [a - b for a, b in acc]
    assert max(gaps) < 3.5, gaps
    assert up[-1][1] * 20 < up[-1][0]
    [cold] = out["compressed_baselines"]  # compressed from round one
    assert cold["curve"][0] < acc[0][0] - 5, (cold["curve"][0], acc[0][0])


def test_a_reply_to_a_denser_past_round_is_discarded_as_late_not_refused():
    from fl_helpers import small_setup
    from tandem.parties.fl import presets
    from tandem.parties.fl.server import FLServer
    from tandem.transports.base import Frame
    from tandem.transports.memory import MemoryNetwork

    _, trainer = small_setup()
    d = trainer.dim
    cfg = presets.compressed(d, warmup=Warmup(1, 0), rounds=2)
    server = FLServer(MemoryNetwork().endpoint("server"), ["c0"], trainer, cfg)
    assert server.uplink == {"kind": "dense"}  # round 0's, the largest: it sizes the bound
    assert server.max_update_bytes > 4 * d
    server.uplink, server.topk = round_compression(cfg.warmup, 1, cfg.uplink, cfg.rule.topk, d)
    assert server.uplink == cfg.uplink
    meta = {"n": 5, "version": 0, "kind": "dense"}
    dense = (np.zeros(d, np.float32),)
    assert server._judge("c0", 1, Frame(meta={**meta, "round": 0}, arrays=dense), {}) == "late"
    refused = server._judge("c0", 1, Frame(meta={**meta, "round": 1}, arrays=dense), {})
    assert refused is not None and "differs from the round's uplink" in refused
