"""The secure sum of the followers' cuts (`tandem.parties.privacy.securesum`)."""

from __future__ import annotations

import asyncio
import json

import jax
import numpy as np
import pytest
from scipy import stats

from spec_helpers import open_security, small_hyper
from tandem.engine.kernels import mlp_stage
from tandem.engine.topology import star
from tandem.errors import AuthenticationError, ConfigError
from tandem.parties.privacy.fixedpoint import Ring, SumOverflowError
from tandem.parties.privacy.masks import KeyShare, mask, prg
from tandem.parties.privacy.securesum import CutSum
from tandem.parties.split import SplitConfig, SplitParty
from tandem.transports.keys import Roster, SigningKey
from tandem.transports.memory import MemoryNetwork

ROWS, FEAT, CUT, K = 32, 4, 3, 3


def agreed_seeds(names, context="spec-hash"):
    """Each follower's seeds, by signed offers relayed (unchanged) through a leader."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    signers = {n: SigningKey(Ed25519PrivateKey.generate()) for n in names}
    roster = Roster({n: [s.public] for n, s in signers.items()})
    shares = {n: KeyShare() for n in names}
    offers = [shares[n].offer(n, signers[n], context) for n in names]
    return {n: shares[n].agree(n, offers, roster, context) for n in names}, signers, roster


# -- pure pieces ---------------------------------------------------------------------------------
def test_ring_round_trip_and_wrapping_sum():
    ring = Ring(bits=32, frac=16, bound=8.0)
    rng = np.random.default_rng(0)
    xs = [rng.uniform(-8, 8, size=(5, 3)) for _ in range(3)]
    acc = sum((ring.encode(x) for x in xs), np.zeros((5, 3), np.uint32))
    np.testing.assert_allclose(ring.decode(acc), sum(xs), atol=3 * 2**-17 + 1e-6)


def test_overflow_refused_by_value_and_by_ring():
    ring = Ring(bits=32, frac=16, bound=4.0)
    with pytest.raises(SumOverflowError, match="model.sum_bound"):
        ring.encode(np.array([[4.5]]))
    with pytest.raises(SumOverflowError, match="model.sum_bound"):
        ring.encode(np.array([[np.nan]]))
    with pytest.raises(SumOverflowError, match="model.sum_ring_bits = 64"):
        Ring(bits=32, frac=16, bound=1024.0).check_parties(64)
    Ring(bits=64, frac=16, bound=1024.0).check_parties(64)


def test_masks_cancel_and_do_not_depend_on_the_split():
    seeds, _, _ = agreed_seeds(["f0", "f1", "f2"])
    rows = np.array([7, 3, 11, 0])
    total = sum(mask(n, seeds[n], 5, rows, 6, np.uint32) for n in seeds)
    assert not total.any()
    whole = prg(seeds["f0"]["f1"], 5, rows, 6, np.uint32)
    parts = np.concatenate(
        [prg(seeds["f0"]["f1"], 5, rows[i : i + 1], 6, np.uint32) for i in range(4)]
    )
    np.testing.assert_array_equal(whole, parts)
    assert not np.array_equal(whole, prg(seeds["f0"]["f1"], 6, rows, 6, np.uint32))


def test_substituted_key_is_refused():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    _, signers, roster = agreed_seeds(["f0", "f1"])
    shares = {n: KeyShare() for n in ("f0", "f1")}
    offers = [shares[n].offer(n, signers[n], "ctx") for n in ("f0", "f1")]
    forged = dict(offers[1], public=KeyShare().public_hex)  # the leader swaps f1's key
    with pytest.raises(AuthenticationError, match="'f1'"):
        shares["f0"].agree("f0", [offers[0], forged], roster, "ctx")
    leader = SigningKey(Ed25519PrivateKey.generate())
    roster2 = Roster(
        {"f0": [signers["f0"].public], "f1": [signers["f1"].public], "leader": [leader.public]}
    )
    resigned = KeyShare().offer("f1", leader, "ctx")  # leader signs a key as f1
    with pytest.raises(AuthenticationError, match="substituted"):
        shares["f0"].agree("f0", [resigned], roster2, "ctx")
    with pytest.raises(ConfigError, match="private_key"):
        KeyShare().offer("f0", None, "ctx")


def test_single_frame_is_uniform_noise():
    """A follower's masked words of a constant cut pass a chi-square test of uniformity."""
    seeds, _, _ = agreed_seeds(["f0", "f1", "f2"])
    cs = CutSum("secure_sum", "top").for_follower("f0", seeds["f0"])
    x = np.full((4096, 8), 1.5, np.float32)  # about as far from noise as a cut gets
    words = cs.seal(x, 1, np.arange(4096), where="test")
    counts = np.bincount((words >> np.uint32(24)).ravel().astype(np.int64), minlength=256)
    assert stats.chisquare(counts).pvalue > 1e-3
    low = np.bincount((words & np.uint32(255)).ravel().astype(np.int64), minlength=256)
    assert stats.chisquare(low).pvalue > 1e-3
    plain = Ring().encode(x)
    assert (
        stats.chisquare(np.bincount((plain >> np.uint32(24)).ravel(), minlength=256)).pvalue < 1e-6
    )


# -- end to end in one process --------------------------------------------------------------------
def job(kind, *, n=1, steps=3, bound=64.0, seed=0, rows=ROWS):
    ROWS = rows  # noqa: N806 (the module's batch size, or a larger one)
    topo = star(K)
    rng = np.random.default_rng(seed)
    models = {f"bottom_{i}": mlp_stage([FEAT], [5], CUT) for i in range(K)}
    models["top"] = mlp_stage([CUT], [5], 1, activate_last=False)
    cfg = SplitConfig(batch_size=ROWS, groups=n, optimizer="sgd", learning_rate=0.1, seed=seed)
    names = [p for p in topo.parties if p != "leader"]
    seeds = agreed_seeds(names)[0] if kind == "secure_sum" else {}
    ring = Ring(bound=bound) if kind == "secure_sum" else None
    base = CutSum(kind, "top", ring)
    net = MemoryNetwork()
    labels = (rng.random(ROWS) > 0.5).astype(np.float32)
    parties = {}
    for p in topo.parties:
        data = rng.normal(size=(ROWS, FEAT)).astype(np.float32)
        parties[p] = SplitParty(
            p,
            topo,
            models,
            net.endpoint(p),
            datasets={"train": data},
            labels={"train": labels} if p == "leader" else None,
            config=cfg,
            cut_sum=base if p == "leader" else base.for_follower(p, seeds.get(p, {})),
        )
    batches = [np.random.default_rng(9).permutation(ROWS) for _ in range(steps)]

    async def main():
        leader = parties["leader"]

        async def drive():
            for idx in batches:
                await leader.run_batch(idx, n=n)
            await leader.stop()

        async with asyncio.TaskGroup() as tg:
            for p, party in parties.items():
                if p != "leader":
                    tg.create_task(party.serve())
            tg.create_task(drive())

    asyncio.run(main())
    return {s: p for party in parties.values() for s, p in party.handler.params.items()}


def close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol)


def test_secure_sum_trains_as_plain_sum_for_any_micro_batch_count():
    plain = job("sum")
    close(job("secure_sum"), plain, atol=1e-4)
    close(job("secure_sum", n=4), plain, atol=1e-4)


def test_secure_sum_of_tiled_groups_trains_as_plain_sum():
    """Groups of more rows than a kernel tile (2048 rows: 4 tiles of 512) are summed and
    unmasked whole, then computed tile by tile: as the plain sum at another count."""
    plain = job("sum", rows=2048, n=4, steps=1)
    close(job("secure_sum", rows=2048, n=1, steps=1), plain, atol=1e-4)


def test_plain_sum_differs_from_concat_shape_checks():
    topo = star(2)
    models = {"bottom_0": mlp_stage([FEAT], [5], CUT), "bottom_1": mlp_stage([FEAT], [5], CUT + 1)}
    models["top"] = mlp_stage([CUT], [5], 1, activate_last=False)
    with pytest.raises(ConfigError, match="one width"):
        SplitParty(
            "leader", topo, models, MemoryNetwork().endpoint("leader"), cut_sum=CutSum("sum", "top")
        )


def leaves(exc: BaseException):
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in leaves(e)]
    return [exc]


def test_overflowing_cut_is_refused_in_training():
    with pytest.raises(BaseExceptionGroup) as info:
        job("secure_sum", bound=1e-3, steps=1)
    errors = leaves(info.value)
    assert any(isinstance(e, SumOverflowError) and "model.sum_bound" in str(e) for e in errors)


# -- the task spec and the [model] keys -----------------------------------------------------------
def star_spec(**hyper):
    from tandem.parties.split.spec import build_spec

    return build_spec(
        star(2),
        features={"follower0": 3, "follower1": 3},
        samples=16,
        stage_widths={
            "bottom_0": {"in_dims": [3], "out_dim": 4},
            "bottom_1": {"in_dims": [3], "out_dim": 4},
            "top": {"in_dims": [4, 4], "out_dim": 1},
        },
        hyper=small_hyper(**hyper),
        security=open_security(),
    )


def test_aggregate_is_part_of_the_spec_and_its_hash():
    from tandem.parties.privacy.securesum import from_spec, mismatch_reasons

    concat, plain = star_spec(), star_spec(aggregate="sum")
    secure = star_spec(aggregate="secure_sum", sum_ring={"bits": 32, "frac": 12, "bound": 8.0})
    assert "aggregate" not in concat.hyper
    assert len({concat.spec_hash(), plain.spec_hash(), secure.spec_hash()}) == 3
    assert secure.hyper["sum_ring"] == {"bits": 32, "frac": 12, "bound": 8.0}
    shapes = secure.channel_shapes()
    assert shapes["act/bottom_0->top"] == ("uint32", (4,))
    assert shapes["grad/bottom_0->top"] == ("float32", (4,))
    assert plain.channel_shapes()["act/bottom_1->top"] == ("float32", (4,))
    cs = from_spec(secure.hyper, star(2))
    assert cs is not None and cs.secure and cs.stage == "top" and cs.ring == Ring(32, 12, 8.0)
    reasons = mismatch_reasons(secure.hyper, {"aggregate": "sum"}, "'follower1'")
    assert len(reasons) == 2 and "'sum'" in reasons[0] and "'secure_sum'" in reasons[0]
    assert mismatch_reasons(plain.hyper, {"aggregate": "sum"}, "f") == []


def test_model_section_keys():
    from tandem.parties.config.sections import Model
    from tandem.parties.privacy.securesum import hyper_of_model

    assert hyper_of_model(Model()) == {}
    m = Model(aggregate="secure_sum", sum_bound=4.0, sum_ring_bits=64)
    assert hyper_of_model(m) == {
        "aggregate": "secure_sum",
        "sum_ring": {"bits": 64, "frac": 16, "bound": 4.0},
    }
    with pytest.raises(Exception, match="aggregate"):
        Model(aggregate="mean")


# -- three `tandem party` processes from TOML alone -----------------------------------------------
def write_star(folder, *, aggregate="secure_sum", keys=True, overrides=None):
    """A leader with labels and two followers with 3 columns each, star topology, per-party
    keys; returns ``{name: (port, toml path)}``."""
    from party_helpers import toml
    from ports import free_port
    from tandem.transports.keys import generate

    rng = np.random.default_rng(0)
    n, rows = 96, 64
    xs = {p: rng.normal(size=(n, 3)).astype("f4") for p in ("f0", "f1")}
    y = (xs["f0"][:, 0] + xs["f1"][:, 0] > 0).astype("f4")
    np.savez(
        folder / "lead.npz",
        x_train=np.zeros((rows, 0), "f4"),
        y_train=y[:rows],
        x_test=np.zeros((n - rows, 0), "f4"),
        y_test=y[rows:],
    )
    for p in ("f0", "f1"):
        np.savez(folder / f"{p}.npz", x_train=xs[p][:rows], x_test=xs[p][rows:])
    names = ("lead", "f0", "f1")
    for name in names:
        generate(name, folder)
    ports = {name: free_port() for name in names}
    out = {}
    for name in names:
        leader = name == "lead"
        sec = {"retry_timeout": 10.0}
        if keys:
            sec.update(private_key=f"{name}.key", public_keys={m: f"{m}.pub" for m in names})
        else:
            sec["secret"] = "s3cret"
        cfg = {
            "role": "leader" if leader else "follower",
            "name": name,
            "export_dir": f"out/{name}",
            "progress": False,
            "wait": 60.0,
            "listen": {"host": "127.0.0.1", "port": ports[name]},
            "peers": {
                m: f"http://127.0.0.1:{ports[m]}"
                for m in names
                if m != name and (leader or m == "lead")
            },
            "security": sec,
            "data": {"source": f"{name}.npz"},
            "topology": {"kind": "star", "leader": "lead", "followers": ["f0", "f1"]},
            "model": {"cut": 4, "hidden": [8], "out": 1, "aggregate": aggregate},
        }
        if leader:
            cfg["schema"] = {"f0": 3, "f1": 3}
            cfg["train"] = {
                "batch_size": 16,
                "epochs": 2,
                "groups": 2,
                "learning_rate": 0.05,
                "seed": 1,
            }
        cfg.update((overrides or {}).get(name, {}))
        path = folder / f"{name}.toml"
        path.write_text(toml(cfg))
        out[name] = (ports[name], path)
    return out


def run_parties(folder, configs, *command, extra=None):
    import os
    import subprocess
    import sys

    from party_helpers import ROOT, Proc

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    procs = {}
    for name, (_, path) in configs.items():
        tag = command[0]
        outf, errf = folder / f"{name}.{tag}.out", folder / f"{name}.{tag}.err"
        with open(outf, "wb") as fo, open(errf, "wb") as fe:
            popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tandem",
                    *command,
                    "--config",
                    str(path),
                    *(extra or {}).get(name, []),
                ],
                cwd=ROOT,
                stdout=fo,
                stderr=fe,
                env=env,
            )
        procs[name] = Proc(popen, outf, errf)
    return {name: p.finish(120.0) for name, p in procs.items()}


def exported_outputs(folder, xs):
    """The leader's outputs computed in the clear from the three exports: top(sum of cuts)."""
    from tandem.parties.export.model import load_model_sync

    cuts = []
    for p in ("f0", "f1"):
        m = load_model_sync(folder / "out" / p, p)
        cuts.append(np.asarray(m.models[f"bottom_{p}"].apply(m.params[f"bottom_{p}"], xs[p])))
    lead = load_model_sync(folder / "out" / "lead", "lead")
    return np.asarray(lead.models["top"].apply(lead.params["top"], cuts[0] + cuts[1]))


@pytest.mark.slow
async def test_three_parties_train_and_predict_with_a_secure_sum_from_toml(tmp_path, capsys):
    """Three `tandem party` processes train; then the three parties' `tandem predict`
    command lines run in this process (`party_helpers.run_commands`) over HTTP."""
    from party_helpers import run_commands

    configs = write_star(tmp_path)
    done = run_parties(tmp_path, configs, "party")
    for name, (rc, line, err) in done.items():
        assert rc == 0 and line and line["status"] == "done", (name, err[-3000:])
    assert len({line["spec_hash"] for _, line, _ in done.values()}) == 1
    # predict the 32 held-out rows with the same secure sum
    xs = {p: np.load(tmp_path / f"{p}.npz")["x_test"] for p in ("f0", "f1")}
    for p, x in xs.items():
        np.save(tmp_path / f"{p}_new.npy", x)
    args = {
        "lead": ["--rows", "32", "--positional", "--out", str(tmp_path / "pred.npy")],
        "f0": ["--data", str(tmp_path / "f0_new.npy"), "--positional"],
        "f1": ["--data", str(tmp_path / "f1_new.npy"), "--positional"],
    }
    capsys.readouterr()
    codes = await run_commands(
        {
            name: ["predict", "--config", str(path), *args[name]]
            for name, (_, path) in configs.items()
        }
    )
    out, err = capsys.readouterr()
    assert codes == {"lead": 0, "f0": 0, "f1": 0}, err[-3000:]
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert sorted(x["party"] for x in lines) == ["f0", "f1", "lead"], out  # a JSON line each
    got = np.load(tmp_path / "pred.npy")
    np.testing.assert_allclose(got, exported_outputs(tmp_path, xs), atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("keys", "overrides", "says"),
    [
        (False, None, "private_key"),
        (True, {"f1": {"model": {"cut": 4, "hidden": [8], "out": 1, "aggregate": "sum"}}}, "'sum'"),
    ],
    ids=["shared-secret-only", "aggregate-mismatch"],
)
def test_secure_sum_start_is_refused_with_the_fix(tmp_path, keys, overrides, says):
    configs = write_star(tmp_path, keys=keys, overrides=overrides)
    done = run_parties(tmp_path, configs, "party")
    rc, _, err = done["lead"]
    assert rc != 0, err[-2000:]
    line = json.loads([ln for ln in err.splitlines() if ln.startswith("{")][-1])
    assert line["status"] == "error" and "refused" in line["reason"], line
    assert says in line["reason"] and "secure_sum" in line["reason"], line["reason"]
