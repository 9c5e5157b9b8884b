"""Cross-party inference (`tandem.parties.split.inference`, `tandem predict`).

One tiny leader/follower model is trained in process over the memory transport and each party
exported; predictions from the exports (API over memory, CLI over HTTP) must equal the trained
in-process model's `SplitParty.predict` on the same new rows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import csv
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import tandem.parties.export.stages
from ports import free_port
from spec_helpers import small_hyper
from tandem.engine.kernels import mlp_stage
from tandem.engine.topology import leader_follower, two_party
from tandem.parties.export import save_stages
from tandem.parties.split import SplitConfig, SplitParty, inference
from tandem.parties.split.inference import InferenceError
from tandem.parties.split.negotiate import NegotiationError
from tandem.parties.split.process import predict_cli
from tandem.transports.memory import MemoryNetwork

F_LEADER, F_FOLLOWER, CUT, NEW = 5, 3, 4, 41
BATCH, GROUPS = 16, 2


@dataclasses.dataclass
class Trained:
    leader: str  # export files
    follower: str
    x_leader: np.ndarray  # new rows
    x_follower: np.ndarray
    reference: np.ndarray  # the trained in-process model's SplitParty.predict on them
    training: str
    root: str


def _models():
    return {
        "bottom_leader": mlp_stage([F_LEADER], [8], CUT),
        "bottom_follower": mlp_stage([F_FOLLOWER], [8], CUT),
        "top": mlp_stage([CUT, CUT], [8], 1, activate_last=False),
    }


async def _train(root: str, seed: int, epochs: int) -> Trained:
    rng = np.random.default_rng(seed)
    xl, xf = rng.normal(size=(96, F_LEADER)), rng.normal(size=(96, F_FOLLOWER))
    y = (xl[:, 0] + xf[:, 0] > 0).astype(np.float32)
    new_l, new_f = rng.normal(size=(NEW, F_LEADER)), rng.normal(size=(NEW, F_FOLLOWER))
    topo, net = leader_follower(), MemoryNetwork()
    cfg = SplitConfig(batch_size=BATCH, groups=GROUPS, learning_rate=0.05, seed=seed)
    leader = SplitParty(
        "leader",
        topo,
        _models(),
        net.endpoint("leader"),
        datasets={"train": xl, "new": new_l},
        labels={"train": y},
        config=cfg,
    )
    follower = SplitParty(
        "follower",
        topo,
        _models(),
        net.endpoint("follower"),
        datasets={"train": xf, "new": new_f},
        config=cfg,
    )
    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        await leader.fit(epochs)
        reference = await leader.predict("new", NEW, batch_size=BATCH)
        await leader.stop()
    paths = {}
    for party in (leader, follower):
        folder = os.path.join(root, party.name)
        os.makedirs(folder, exist_ok=True)
        paths[party.name] = os.path.join(folder, f"{party.name}.safetensors")
        await inference.export_party(party, paths[party.name])
    np.savez(os.path.join(root, "train.npz"), x_train=xl, y_train=y)
    return Trained(
        paths["leader"],
        paths["follower"],
        new_l.astype(np.float32),
        new_f.astype(np.float32),
        reference,
        leader.run_id,
        root,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trained:
    return asyncio.run(_train(str(tmp_path_factory.mktemp("run_a")), seed=0, epochs=3))


@pytest.fixture(scope="module")
def other_run(tmp_path_factory) -> Trained:
    """A second training of the same model (same shapes, another training id)."""
    return asyncio.run(_train(str(tmp_path_factory.mktemp("run_b")), seed=1, epochs=1))


async def _outcome(coro):
    """The coroutine's result or the exception it raised (so a refusal does not cancel the
    peer before it has read the refusal)."""
    try:
        return await coro
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc


async def _pair(leader_coro, follower_coro):
    """Run both parties; a side failing outside the negotiation cancels the other (which
    would otherwise wait for it forever)."""
    async with asyncio.TaskGroup() as tg:
        lt = tg.create_task(_outcome(leader_coro))
        ft = tg.create_task(_outcome(follower_coro))
        for me, other in ((lt, ft), (ft, lt)):
            me.add_done_callback(
                lambda t, o=other: (
                    o.cancel()
                    if not t.cancelled()
                    and isinstance(t.result(), Exception)
                    and not isinstance(t.result(), NegotiationError)
                    else None
                )
            )
    return lt.result(), ft.result()


_SAME = object()


async def _predict_pair(lm, fm, xl, xf, *, alignment=None, follower_alignment=_SAME):
    """`inference.predict` and `inference.serve` over a fresh memory network."""
    net = MemoryNetwork()
    return await _pair(
        inference.predict(
            net.endpoint("leader"), lm, xl, batch_size=BATCH, groups=GROUPS, alignment=alignment
        ),
        inference.serve(
            net.endpoint("follower"),
            fm,
            xf,
            alignment=alignment if follower_alignment is _SAME else follower_alignment,
        ),
    )


# -- matches in-process ----------------------------------------------------------------------
async def test_api_over_memory_matches_in_process(trained):
    lm = await inference.load_model(trained.leader, "leader")
    fm = await inference.load_model(trained.follower, "follower")
    res, served = await _predict_pair(lm, fm, trained.x_leader, trained.x_follower)
    assert not isinstance(res, Exception), res
    assert served == -(-NEW // BATCH)
    assert res.outputs.shape == (NEW, 1) and res.training == trained.training
    assert res.digests == {"leader": lm.digest, "follower": fm.digest}
    np.testing.assert_allclose(res.outputs, trained.reference, rtol=1e-6, atol=1e-6)
    # the trained model differs from a fresh one: a wrong parameter load could not match
    fresh = dataclasses.replace(
        lm, params={s: lm.models[s].init(jax.random.PRNGKey(7)) for s in lm.params}
    )
    out2, _ = await _predict_pair(fresh, fm, trained.x_leader, trained.x_follower)
    assert np.abs(out2.outputs - trained.reference).max() > 1e-3


async def test_two_party_topology_leader_without_features(tmp_path):
    """The label owner reads no features (bottom on A, top on B): it gives the row count."""
    topo, net = two_party(), MemoryNetwork()
    rng = np.random.default_rng(3)
    x, y, new = (
        rng.normal(size=(32, 3)),
        (rng.random(32) > 0.5).astype(np.float32),
        rng.normal(size=(9, 3)),
    )
    models = {
        "bottom": mlp_stage([3], [6], CUT),
        "top": mlp_stage([CUT], [6], 1, activate_last=False),
    }
    cfg = SplitConfig(batch_size=8, groups=1, learning_rate=0.05)
    b = SplitParty("B", topo, models, net.endpoint("B"), labels={"train": y}, config=cfg)
    a = SplitParty(
        "A", topo, models, net.endpoint("A"), datasets={"train": x, "new": new}, config=cfg
    )
    async with asyncio.TaskGroup() as tg:
        tg.create_task(a.serve())
        await b.fit(1)
        ref = await b.predict("new", 9, batch_size=4)
        await b.stop()
    for p in (a, b):
        await inference.export_party(p, tmp_path / f"{p.name}.safetensors")
    bm = await inference.load_model(tmp_path / "B.safetensors", "B")
    am = await inference.load_model(tmp_path, "A")  # a folder holding A.safetensors
    net2 = MemoryNetwork()
    out, served = await _pair(
        inference.predict(net2.endpoint("B"), bm, rows=9, batch_size=4),
        inference.serve(net2.endpoint("A"), am, new),
    )
    assert served == 3
    np.testing.assert_allclose(out.outputs, ref, rtol=1e-6, atol=1e-6)


# -- each party loads only its own export; the wire carries activations only -----------------
PARTY = contextvars.ContextVar("party", default="?")


async def test_each_party_reads_only_its_own_export_and_receives_activations(trained, monkeypatch):
    opened: list[tuple[str, str]] = []
    real_open = tandem.parties.export.stages.safe_open

    def recording_open(path, *a, **kw):
        opened.append((PARTY.get(), os.fspath(path)))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(tandem.parties.export.stages, "safe_open", recording_open)
    net = MemoryNetwork()
    received: dict[str, list] = {"leader": [], "follower": []}
    endpoints = {}
    for name in ("leader", "follower"):
        ep = net.endpoint(name)
        real_recv = ep.recv

        async def recv(peer, channel, _real=real_recv, _name=name):
            frame = await _real(peer, channel)
            received[_name].append(frame)
            return frame

        ep.recv = recv
        endpoints[name] = ep

    async def party(name, path, x):
        PARTY.set(name)  # copied into the worker threads of load_model
        model = await inference.load_model(path, name)
        assert set(model.params) == {s.name for s in model.topology.stages_of(name)}
        if name == "leader":
            return await inference.predict(
                endpoints[name], model, x, batch_size=BATCH, groups=GROUPS
            )
        return await inference.serve(endpoints[name], model, x)

    out, _ = await _pair(
        party("leader", trained.leader, trained.x_leader),
        party("follower", trained.follower, trained.x_follower),
    )
    np.testing.assert_allclose(out.outputs, trained.reference, rtol=1e-6, atol=1e-6)
    assert {p for p, _ in opened} == {"leader", "follower"}
    for who, path in opened:
        assert path == (trained.leader if who == "leader" else trained.follower), (who, path)
    # follower: commands only, whose one array is int64 row indices into the new rows
    assert received["follower"] and {f.channel for f in received["follower"]} == {"ctl"}
    for f in received["follower"]:
        assert all(a.dtype == np.int64 and a.ndim == 1 and a.max() < NEW for a in f.arrays)
    # prediction walks the new rows in order: each batch command names a range, no array
    batches = [f for f in received["follower"] if f.meta.get("cmd") == "batch"]
    assert all(not f.arrays for f in batches)
    assert [f.meta["rows"]["range"] for f in batches] == [
        [lo, min(lo + BATCH, NEW)] for lo in range(0, NEW, BATCH)
    ]
    # leader: the follower's negotiation replies (no arrays) and cut-layer activations
    acts = [f for f in received["leader"] if f.channel != "ctl"]
    assert {f.channel for f in acts} == {"act/bottom_follower->top"}
    assert all(not f.arrays for f in received["leader"] if f.channel == "ctl")
    assert sum(f.arrays[0].shape[0] for f in acts) == NEW
    assert all(f.arrays[0].shape[1] == CUT and f.arrays[0].dtype == np.float32 for f in acts)


async def test_width_only_stand_ins_hold_no_parameters(trained):
    fm = await inference.load_model(trained.follower, "follower")
    assert set(fm.params) == {"bottom_follower"}
    assert fm.widths == {"bottom_leader": CUT, "bottom_follower": CUT, "top": 1}
    with pytest.raises(InferenceError, match="belongs to another party"):
        fm.models["top"].init(None)


# -- refusals --------------------------------------------------------------------------------
def _refused(result, *needles):
    assert isinstance(result, NegotiationError), result
    for needle in needles:
        assert needle in str(result), (needle, str(result))


async def test_exports_of_different_trainings_refused(trained, other_run):
    lm = await inference.load_model(trained.leader, "leader")
    fm = await inference.load_model(other_run.follower, "follower")
    assert lm.training != fm.training
    out, served = await _predict_pair(lm, fm, trained.x_leader, trained.x_follower)
    for side in (out, served):
        _refused(side, "different trainings", lm.training, fm.training)


async def test_leader_checks_the_followers_model_too(trained, other_run, monkeypatch):
    """A follower whose own check lets everything through (a bug, or another version) is
    still refused: the leader checks the model description every follower sends."""
    monkeypatch.setattr(inference, "inference_check", lambda *a, **k: lambda spec: [])
    lm = await inference.load_model(trained.leader, "leader")
    fm = await inference.load_model(other_run.follower, "follower")
    out, served = await _predict_pair(lm, fm, trained.x_leader, trained.x_follower)
    _refused(out, "refused the followers' models", f"training {fm.training!r}")
    _refused(served, "the leader refused the model of 'follower'", lm.training)


async def test_wrong_row_count_refused(trained):
    lm = await inference.load_model(trained.leader, "leader")
    fm = await inference.load_model(trained.follower, "follower")
    out, served = await _predict_pair(lm, fm, trained.x_leader, trained.x_follower[:-1])
    for side in (out, served):
        _refused(side, f"predicts {NEW} rows but 'follower' holds {NEW - 1}")


async def test_alignment_commitments_must_agree(trained):
    lm = await inference.load_model(trained.leader, "leader")
    fm = await inference.load_model(trained.follower, "follower")
    a = {"size": NEW, "commitment": "ab" * 32}
    b = {"size": NEW, "commitment": "cd" * 32}
    out, served = await _predict_pair(
        lm, fm, trained.x_leader, trained.x_follower, alignment=a, follower_alignment=b
    )
    for side in (out, served):
        _refused(side, "aligned differently")
    out, served = await _predict_pair(
        lm, fm, trained.x_leader, trained.x_follower, alignment=a, follower_alignment=None
    )
    _refused(served, "only the leader gave an aligned-ids file")
    out, _ = await _predict_pair(lm, fm, trained.x_leader, trained.x_follower, alignment=a)
    np.testing.assert_allclose(out.outputs, trained.reference, rtol=1e-6, atol=1e-6)


async def test_follower_refuses_a_training_proposal(trained):
    from tandem.parties.split.spec import build_spec

    fm = await inference.load_model(trained.follower, "follower")
    topo = leader_follower()
    hyper = small_hyper(threshold=4, checkpoint_every=10)
    widths = {
        "bottom_leader": {"in_dims": [F_LEADER], "out_dim": CUT, "sizes": None},
        "bottom_follower": {"in_dims": [F_FOLLOWER], "out_dim": CUT, "sizes": None},
        "top": {"in_dims": [CUT, CUT], "out_dim": 1, "sizes": None},
    }
    spec = build_spec(
        topo,
        features={"leader": F_LEADER, "follower": F_FOLLOWER},
        samples=NEW,
        stage_widths=widths,
        hyper=hyper,
        security=inference.NO_SECURITY,
    )
    reasons = inference.inference_check(fm, rows=NEW)(spec)
    assert len(reasons) == 1 and "proposes training" in reasons[0]


async def test_training_follower_refuses_a_prediction_spec(trained, tmp_path):
    from tandem.parties.split.process.party_config import PartyData, load_party_config
    from tandem.parties.split.process.session import follower_check

    cfg = load_party_config(_configs(trained, tmp_path)["follower"])
    lm = await inference.load_model(trained.leader, "leader")
    spec = inference.inference_spec(lm, rows=NEW, security=cfg.security())
    reasons = follower_check(cfg, PartyData(train=trained.x_follower))(spec)
    assert any("no dataset schema for 'follower'" in r for r in reasons), reasons


# -- bad input -------------------------------------------------------------------------------
async def test_bad_inputs_name_the_problem_and_the_fix(trained, tmp_path):
    with pytest.raises(InferenceError, match="no export at .*nowhere"):
        await inference.load_model(tmp_path / "nowhere.safetensors", "leader")
    with pytest.raises(InferenceError, match="holds the stages of party 'leader', not 'follower'"):
        await inference.load_model(trained.leader, "follower")
    with pytest.raises(InferenceError, match="topology"):
        await inference.load_model(trained.leader, "leader", topology=two_party("leader", "x"))
    bare = tmp_path / "bare.safetensors"
    lm = await inference.load_model(trained.leader, "leader")
    save_stages(bare, lm.params, topology=lm.topology.to_dict(), party="leader")
    with pytest.raises(InferenceError, match=r"lacks \['widths', 'training'"):
        await inference.load_model(bare, "leader")
    fm = await inference.load_model(trained.follower, "follower")
    with pytest.raises(InferenceError, match="4 feature columns but 'follower'.* trained on 3"):
        inference.check_rows(fm, np.zeros((5, 4)))
    nan = trained.x_follower.copy()
    nan[7, 2] = np.nan
    with pytest.raises(InferenceError, match="row 7, column 2"):
        await inference.serve(MemoryNetwork().endpoint("follower"), fm, nan)
    with pytest.raises(InferenceError, match="call serve"):
        await inference.predict(MemoryNetwork().endpoint("follower"), fm, trained.x_follower)


# -- the command line ------------------------------------------------------------------------
def _configs(trained: Trained, folder) -> dict[str, str]:
    pl, pf = free_port(), free_port()
    train = os.path.join(trained.root, "train.npz")
    common = f'secret = "s3"\n[model]\ntopology = "leader_follower"\ncut = {CUT}\n'
    files = {}
    for name, port, peer, peer_port, extra in (
        ("leader", pl, "follower", pf, f"[schema]\nfollower = {F_FOLLOWER}\n"),
        ("follower", pf, "leader", pl, ""),
    ):
        path = os.path.join(folder, f"{name}.toml")
        with open(path, "w") as f:
            f.write(
                f'role = "{name}"\nname = "{name}"\nwait = 60\n'
                f'export_dir = "{os.path.dirname(getattr(trained, name))}"\n'
                f'[listen]\nport = {port}\n[peers]\n{peer} = "http://127.0.0.1:{peer_port}"\n'
                f'[data]\nsource = "{train}"\n{extra}[security]\n{common}'
            )
        files[name] = path
    return files


def _new_rows(trained: Trained, folder):
    """Leader rows as CSV with an id column, follower rows as .npy, each in its own order,
    and both parties' `tandem align --out` files of one alignment (ids in one agreed order)."""
    rng = np.random.default_rng(5)
    ids = [f"c{i:03d}" for i in range(NEW)]
    perm_l, perm_f = rng.permutation(NEW), rng.permutation(NEW)
    with open(os.path.join(folder, "new_l.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cid"] + [f"l{j}" for j in range(F_LEADER)])
        for i in perm_l:
            w.writerow([ids[i]] + [repr(float(v)) for v in trained.x_leader[i]])
    np.save(os.path.join(folder, "new_f.npy"), trained.x_follower[perm_f])
    order = sorted(range(NEW), key=lambda i: ids[i])[::-1][: NEW - 5]  # 36 shared ids
    for name, perm in (("l", perm_l), ("f", perm_f)):
        where = {int(i): r for r, i in enumerate(perm)}
        with open(os.path.join(folder, f"aligned_{name}.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["row", "id"])
            w.writerows([where[i], ids[i]] for i in order)
    return order, ids


@pytest.mark.slow
def test_cli_two_processes_over_http_match_in_process(trained, tmp_path):
    cfg = _configs(trained, tmp_path)
    order, ids = _new_rows(trained, tmp_path)
    out = tmp_path / "pred.csv"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    base = [sys.executable, "-m", "tandem", "predict", "--timeout", "100"]
    procs = {
        "follower": subprocess.Popen(
            base
            + [
                "--config",
                cfg["follower"],
                "--data",
                str(tmp_path / "new_f.npy"),
                "--aligned",
                str(tmp_path / "aligned_f.csv"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        ),
        "leader": subprocess.Popen(
            base
            + [
                "--config",
                cfg["leader"],
                "--data",
                str(tmp_path / "new_l.csv"),
                "--id-column",
                "cid",
                "--aligned",
                str(tmp_path / "aligned_l.csv"),
                "--out",
                str(out),
                "--batch-size",
                str(BATCH),
                "--groups",
                str(GROUPS),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        ),
    }
    results = {}
    try:
        for name, p in procs.items():
            results[name] = p.communicate(timeout=110)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    for name, p in procs.items():
        assert p.returncode == 0, (name, results[name][1][-3000:])
    summary = {n: json.loads(r[0].strip().splitlines()[-1]) for n, r in results.items()}
    assert summary["leader"]["rows"] == summary["follower"]["rows"] == len(order)
    assert summary["leader"]["training"] == summary["follower"]["training"] == trained.training
    assert summary["leader"]["spec_hash"] == summary["follower"]["spec_hash"]
    assert summary["follower"]["export"] == trained.follower
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["id"] for r in rows] == [ids[i] for i in order]
    logits = np.array([float(r["logit"]) for r in rows])
    np.testing.assert_allclose(logits, trained.reference[order, 0], rtol=1e-6, atol=1e-6)
    probs = np.array([float(r["probability"]) for r in rows])
    np.testing.assert_allclose(probs, 1 / (1 + np.exp(-logits)), rtol=1e-6)


def _parse(argv):
    parser = argparse.ArgumentParser()
    predict_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


async def test_cli_over_http_refuses_another_training(trained, other_run, tmp_path, capsys):
    cfg = _configs(trained, tmp_path)
    lead = _parse(
        [
            "predict",
            "--config",
            cfg["leader"],
            "--data",
            str(tmp_path / "l.npy"),
            "--out",
            str(tmp_path / "p.npy"),
            "--timeout",
            "60",
            "--positional",
        ]
    )
    follow = _parse(
        [
            "predict",
            "--config",
            cfg["follower"],
            "--export",
            other_run.follower,
            "--data",
            str(tmp_path / "f.npy"),
            "--timeout",
            "60",
            "--positional",
        ]
    )
    np.save(tmp_path / "l.npy", trained.x_leader)
    np.save(tmp_path / "f.npy", trained.x_follower)
    async with asyncio.TaskGroup() as tg:
        rl = tg.create_task(lead.func(lead))
        rf = tg.create_task(follow.func(follow))
    assert rl.result() == rf.result() == 1
    err = capsys.readouterr().err
    assert err.count("different trainings") == 2 and trained.training in err
    assert not (tmp_path / "p.npy").exists()


async def test_cli_bad_input_exits_with_a_readable_error(trained, tmp_path, capsys):
    cfg = _configs(trained, tmp_path)
    np.save(tmp_path / "wide.npy", np.zeros((4, F_FOLLOWER + 2)))
    args = _parse(["predict", "--config", cfg["follower"], "--data", str(tmp_path / "wide.npy")])
    assert await args.func(args) == 2
    assert "5 feature columns but 'follower'" in capsys.readouterr().err
    args = _parse(["predict", "--config", cfg["leader"], "--data", str(tmp_path / "wide.npy")])
    assert await args.func(args) == 2
    assert "pass --out" in capsys.readouterr().err
    args = _parse(
        [
            "predict",
            "--config",
            cfg["follower"],
            "--export",
            trained.leader,
            "--data",
            str(tmp_path / "wide.npy"),
        ]
    )
    assert await args.func(args) == 2
    assert "holds the stages of party 'leader', not 'follower'" in capsys.readouterr().err


@pytest.mark.slow
async def test_predict_from_tandem_party_exports_reproduces_its_evaluation(tmp_path, capsys):
    """End to end: `tandem party` trains (two processes) and exports; `tandem predict` on the
    test rows with those exports and configs gives the test metrics the training reported."""
    from party_helpers import Job
    from tandem.parties.split.metrics import classification_metrics

    job = Job(tmp_path / "job", epochs=1)
    results = await asyncio.to_thread(job.run_both)
    (rc_l, lead, err_l), (rc_f, _, err_f) = results["leader"], results["follower"]
    assert rc_l == rc_f == 0, err_l[-2000:] + err_f[-2000:]
    with np.load(job.folder / "leader.npz") as z:
        np.save(tmp_path / "l.npy", z["x_test"])
        y_test = z["y_test"]
    with np.load(job.folder / "follower.npz") as z:
        np.save(tmp_path / "f.npy", z["x_test"])
    out = tmp_path / "p.npy"
    lead_args = _parse(
        [
            "predict",
            "--config",
            str(job.path("leader")),
            "--data",
            str(tmp_path / "l.npy"),
            "--out",
            str(out),
            "--groups",
            "2",
            "--timeout",
            "60",
            "--positional",
        ]
    )
    fol_args = _parse(
        [
            "predict",
            "--config",
            str(job.path("follower")),
            "--data",
            str(tmp_path / "f.npy"),
            "--timeout",
            "60",
            "--positional",
        ]
    )
    async with asyncio.TaskGroup() as tg:
        rl = tg.create_task(lead_args.func(lead_args))
        rf = tg.create_task(fol_args.func(fol_args))
    assert rl.result() == rf.result() == 0, capsys.readouterr().err[-2000:]
    logits = np.load(out)
    m = classification_metrics(logits, y_test, "binary")
    assert m["accuracy"] == pytest.approx(lead["test_accuracy"], abs=1e-9)
    assert m["loss"] == pytest.approx(lead["test_loss"], rel=1e-6)
    from tandem.parties.export import read_description

    trained_by = read_description(job.folder / "out" / "leader" / "leader.safetensors")
    summaries = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert len(summaries) == 2
    assert {s["training"] for s in summaries} == {trained_by["training"]}


async def test_aligned_rows_whose_ids_moved_are_refused(trained, tmp_path):
    """`--aligned` with `--id-column`: a data file reordered after `tandem align` is refused,
    naming the row and both ids, never predicted on the rows now at those positions."""
    lm = await inference.load_model(trained.leader, "leader")
    _new_rows(trained, tmp_path)
    with open(tmp_path / "new_l.csv", newline="") as f:
        header, *lines = list(csv.reader(f))
    with open(tmp_path / "moved.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *lines[::-1]])
    argv = ["predict", "--config", "x.toml", "--data", str(tmp_path / "new_l.csv")]
    argv += ["--id-column", "cid", "--aligned", str(tmp_path / "aligned_l.csv")]
    x, _, ids = predict_cli.read_inputs(lm, _parse(argv))
    assert len(x) == len(ids) == NEW - 5
    argv[4] = str(tmp_path / "moved.csv")
    with pytest.raises(InferenceError, match=r"says row \d+ of .*moved.csv.* has id 'c040'"):
        predict_cli.read_inputs(lm, _parse(argv))
