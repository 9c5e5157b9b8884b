"""In-process tests of the standalone party plumbing: `session.connect` over real HTTP on
loopback (spec hash and validator installed, refusals), the party metrics source, checkpoint
agreement, and `CheckpointStore` (atomic save, exact round trip, index/discard, errors)."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from party_helpers import Job
from spec_helpers import open_security, small_hyper
from tandem.errors import FrameError
from tandem.parties.split import negotiate
from tandem.parties.split.checkpoint import CheckpointError, CheckpointStore
from tandem.parties.split.process.party_config import load_party_config
from tandem.parties.split.process.session import PartyStartError, connect
from tandem.parties.split.process.standalone import make_party
from tandem.transports.base import Frame
from tandem.transports.memory import MemoryNetwork


def configs(tmp_path, tweak=None):
    job = Job(tmp_path)
    for role in ("leader", "follower"):
        job.cfg[role]["wait"] = 20.0
    for (role, section, key), value in (tweak or {}).items():
        job.cfg[role][section][key] = value
    job.write()
    return job, {r: load_party_config(job.path(r)) for r in ("leader", "follower")}


async def connect_both(cfgs, **kwargs):
    async with asyncio.TaskGroup() as tg:
        lead = tg.create_task(connect(cfgs["leader"], **kwargs.get("leader", {})))
        fol = tg.create_task(connect(cfgs["follower"], **kwargs.get("follower", {})))
    return lead.result(), fol.result()


async def test_connect_installs_spec_and_refuses_foreign_frames(tmp_path):
    _, cfgs = configs(tmp_path)
    lead, fol = await connect_both(cfgs)
    try:
        assert lead.spec_hash == fol.spec_hash == lead.spec.spec_hash()
        assert lead.transport.spec_hash == fol.transport.spec_hash == lead.spec_hash
        assert lead.step == fol.step == 0
        assert lead.spec.alignment["size"] == 64 and lead.spec.hyper["test_samples"] == 24
        ch = "act/bottom_follower->top"
        ok = np.ones((5, 4), np.float32)
        first = {"b": 0, "m": 0}  # what the runtime sends first (no party checks its plan yet)
        await fol.transport.send("leader", ch, Frame(meta=first, arrays=(ok,)))
        assert (await lead.transport.recv("follower", ch)).arrays[0].shape == (5, 4)
        for bad, says in (
            (ok.astype(np.float64), "float64[5, 4]"),
            (np.ones((5, 3), np.float32), "float32[5, 3]"),
            (np.ones((300, 4), np.float32), "float32[300, 4]"),
        ):
            with pytest.raises(
                FrameError,
                match=r"\(422\).*"
                + says.replace("[", r"\[")
                + r".*the spec says float32\[rows, 4\]",
            ):
                await fol.transport.send("leader", ch, Frame(meta=first, arrays=(bad,)))
        with pytest.raises(FrameError, match="not part of the negotiated task"):
            await fol.transport.send("leader", "act/elsewhere", Frame(meta=first, arrays=(ok,)))
        fol.transport.spec_hash = "0" * 64  # a party of another task
        with pytest.raises(FrameError, match=r"\(409\).*both parties must negotiate"):
            await fol.transport.send("leader", ch, Frame(meta=first, arrays=(ok,)))
    finally:
        await lead.transport.aclose()
        await fol.transport.aclose()


async def test_refusal_lists_every_reason_on_both_sides(tmp_path):
    _, cfgs = configs(tmp_path, {("follower", "model", "hidden"): [9]})
    with np.load(tmp_path / "follower.npz") as z:  # the follower lacks the test split
        np.savez(tmp_path / "follower.npz", x_train=z["x_train"])
    async with asyncio.TaskGroup() as tg:

        async def side(role):
            try:
                await connect(cfgs[role])
            except negotiate.NegotiationError as exc:
                return exc

        lt, ft = tg.create_task(side("leader")), tg.create_task(side("follower"))
    lead_err, fol_err = lt.result(), ft.result()
    for err in (lead_err, fol_err):
        assert isinstance(err, negotiate.NegotiationError)
        assert (
            "stage 'bottom_follower': 'follower' has sizes [3, 9, 4] but the spec says "
            "[3, 8, 4]" in str(err)
        )
        assert "the leader evaluates on 24 test rows but 'follower' holds 0" in str(err)
    assert lead_err.reasons.keys() == {"follower"}


async def test_unreachable_peer_is_named(tmp_path):
    _, cfgs = configs(tmp_path)
    import dataclasses

    cfg = dataclasses.replace(cfgs["leader"], wait=0.3)
    with pytest.raises(
        PartyStartError,
        match=r"peers not reachable after 0.3 s: follower at "
        r"http://127.0.0.1:\d+",
    ):
        await connect(cfg)


async def test_party_metrics_on_the_transport_endpoint(tmp_path):
    _, cfgs = configs(tmp_path)
    lead, fol = await connect_both(cfgs)
    try:
        from tandem.parties.split.observe import party_metrics

        parties = {}
        for s in (lead, fol):
            parties[s.config.name] = p = make_party(s.spec, s.config, s.data, s.transport)
            s.transport.add_metrics_source(party_metrics(p, lambda: 7))
        async with asyncio.TaskGroup() as tg:
            tg.create_task(parties["follower"].serve())
            await parties["leader"].run_batch(np.arange(16), n=2)
            await parties["leader"].stop()
        for s in (lead, fol):
            text = s.transport.metrics_text()
            me = s.config.name
            peer = "follower" if me == "leader" else "leader"
            assert f'tandem_party_n_groups{{party="{me}"}} 2' in text
            assert f'tandem_party_step{{party="{me}"}} 1' in text
            assert f'tandem_party_checkpoint_step{{party="{me}"}} 7' in text
            assert f'tandem_party_ops_total{{party="{me}",kind="forward"}} 2' in text
            assert f'tandem_party_op_seconds_total{{party="{me}",kind="forward"}}' in text
            assert f'tandem_sent_bytes_total{{party="{me}",peer="{peer}"}}' in text
            assert "tandem_inbound_queue_depth" in text
            assert "tandem_party_outbound_queue_max" in text
    finally:
        await lead.transport.aclose()
        await fol.transport.aclose()


# -- checkpoint agreement -------------------------------------------------------------------------
def _tiny_spec():
    from tandem.engine.topology import leader_follower
    from tandem.parties.split.spec import build_spec

    topo = leader_follower()
    return build_spec(
        topo,
        features={"leader": 2, "follower": 2},
        samples=8,
        stage_widths={
            "bottom_leader": {"in_dims": [2], "out_dim": 2},
            "bottom_follower": {"in_dims": [2], "out_dim": 2},
            "top": {"in_dims": [2, 2], "out_dim": 1},
        },
        hyper=small_hyper(
            batch_size=4, eval_batch_size=4, threshold=1, capacity=2, checkpoint_every=3
        ),
        security=open_security(reject_nonfinite=True),
    )


async def test_agreement_takes_newest_common_step_in_the_save_window():
    """The leader saved step 6; the follower died before saving it: both resume from 3."""
    spec = _tiny_spec()
    net = MemoryNetwork()
    lt, ft = net.endpoint("leader"), net.endpoint("follower")

    async def follower():
        got, step = await negotiate.answer(
            ft, "leader", check=lambda s: [], checkpoints=lambda h: [3] if h == got_hash else []
        )
        await negotiate.ready(ft, "leader")
        return step

    got_hash = spec.spec_hash()
    async with asyncio.TaskGroup() as tg:
        f = tg.create_task(follower())
        step = await negotiate.propose(lt, ["follower"], spec, checkpoints=[3, 6])
    assert step == f.result() == 3


@pytest.mark.parametrize(
    ("leader_done", "follower_done", "want"),
    [([6], [6], (6, True)), ([6], [], (6, False)), ([], [6], (6, False)), ([6], [3], (6, False))],
)
async def test_agreement_is_finished_only_where_every_party_finished(
    leader_done, follower_done, want
):
    """A finished checkpoint holds the trajectory too: beside another party's periodic one at
    the same step it is an ordinary resume point; only all-finished means "train nothing"."""
    spec = _tiny_spec()
    net = MemoryNetwork()
    lt, ft = net.endpoint("leader"), net.endpoint("follower")

    async def follower():
        _, agreed = await negotiate.answer_agreement(
            ft,
            "leader",
            check=lambda s: [],
            checkpoints=lambda h: [3, 6],
            finished=lambda h: follower_done,
        )
        await negotiate.ready(ft, "leader")
        return agreed

    async with asyncio.TaskGroup() as tg:
        f = tg.create_task(follower())
        agreed = await negotiate.propose_agreement(
            lt, ["follower"], spec, checkpoints=[3, 6], finished=leader_done
        )
    assert (agreed.step, agreed.finished) == want
    assert f.result() == agreed


# -- CheckpointStore ------------------------------------------------------------------------------
def _handler_state(seed=0):
    import jax
    import optax

    from tandem.engine.kernels import mlp_stage
    from tandem.engine.topology import leader_follower
    from tandem.parties.split.stages import StageHandler

    models = {
        "bottom_leader": mlp_stage([3], [5], 2),
        "bottom_follower": mlp_stage([2], [5], 2),
        "top": mlp_stage([2, 2], [4], 1, activate_last=False),
    }
    from tandem.engine.kernels import get_loss

    h = StageHandler(
        leader_follower(),
        "leader",
        models,
        optax.adam(0.1),
        loss=get_loss("binary"),
        key=jax.random.PRNGKey(seed),
    )
    return h.params, h.opt_state


def test_checkpoint_round_trip_is_exact_and_checked(tmp_path):
    import jax

    params, opt = _handler_state()
    store = CheckpointStore(tmp_path / "ck", party="leader", keep=2)
    for step in (2, 4, 6):
        store.save(
            step,
            params=params,
            opt_state=opt,
            spec_hash="h1",
            cursor={"epoch": 1, "batch": step},
            extra={"run_id": "r"},
        )
    (tmp_path / "ck" / ".step-8.junk.tmp").write_bytes(b"half a file")
    assert store.all_steps() == [4, 6]  # keep=2; the stray tmp file is no checkpoint
    assert store.index() == {4: "h1", 6: "h1"} and store.steps("other") == []
    fresh_p, fresh_o = _handler_state(seed=1)
    r = store.load(6, params_like=fresh_p, opt_state_like=fresh_o, spec_hash="h1")
    assert r.cursor == {"epoch": 1, "batch": 6} and r.extra == {"run_id": "r"}
    for a, b in zip(
        jax.tree_util.tree_leaves((params, opt)),
        jax.tree_util.tree_leaves((r.params, r.opt_state)),
        strict=True,
    ):
        assert np.asarray(a).dtype == b.dtype and np.array_equal(np.asarray(a), b)
    with pytest.raises(CheckpointError, match="saved for task spec"):
        store.load(6, params_like=fresh_p, opt_state_like=fresh_o, spec_hash="h2")
    with pytest.raises(CheckpointError, match="belongs to party 'leader'"):
        CheckpointStore(tmp_path / "ck", party="follower").load(
            6, params_like=fresh_p, opt_state_like=fresh_o
        )
    wrong = {**fresh_p, "top": fresh_p["bottom_leader"]}
    with pytest.raises(CheckpointError, match="top"):
        store.load(6, params_like=wrong, opt_state_like=fresh_o)
    assert store.discard_after(4) == [6] and store.all_steps() == [4]
    (tmp_path / "ck" / "step-000000009.safetensors").write_bytes(b"garbage")
    assert store.index() == {4: "h1"}  # unreadable files are not offered to the peers


# -- stop / grace helpers -------------------------------------------------------------------------
async def test_with_grace_finishes_aborts_and_raises():
    from tandem.parties.split.process.graceful import until as _until
    from tandem.parties.split.process.graceful import with_grace as _with_grace

    stop = asyncio.Event()

    async def quick():
        return 1

    assert await _with_grace(stop, 0.0, quick(), []) is True
    never = asyncio.Event()
    helper_cancelled = asyncio.Event()

    async def helper():
        try:
            await never.wait()
        finally:
            helper_cancelled.set()

    stop.set()  # a stop request, and the work never ends: cancelled after grace
    assert await _with_grace(stop, 0.01, never.wait(), [helper()]) is False
    assert helper_cancelled.is_set()

    async def broken():
        raise FrameError("boom")

    with pytest.raises(FrameError, match="boom"):  # raised as itself, not grouped
        await _with_grace(asyncio.Event(), 1.0, broken(), [])
    assert await _until(stop, never.wait()) is None  # stop wins
    assert await _until(asyncio.Event(), quick()) == 1


def test_finished_checkpoint_holds_the_trajectory_and_the_best(tmp_path):
    """A finished checkpoint is a periodic one plus a flag and, optionally, the parameters the
    run ended on: a reader ignoring the flag gets the trajectory; `best` needs `finished`."""
    import jax

    params, opt = _handler_state()
    best, _ = _handler_state(seed=2)
    store = CheckpointStore(tmp_path / "ck", party="leader", keep=3)
    common = dict(opt_state=opt, spec_hash="h", cursor={"epoch": 0, "batch": 3})
    store.save(3, params=params, **common)
    store.save(5, params=params, **common, finished=True, best=best)
    with pytest.raises(CheckpointError, match="only a finished checkpoint"):
        store.save(6, params=params, **common, best=best)
    assert store.finished() == {5} and store.index() == {3: "h", 5: "h"}
    assert os.path.exists(store.finished_path(5)) and not os.path.exists(store.path(5))
    os.rename(store.finished_path(5), store.path(5))  # a name that hides what it holds
    with pytest.raises(CheckpointError, match="disagrees with its name"):
        store.read_meta(5)
    assert store.index() == {3: "h"}  # not offered as a periodic checkpoint
    os.rename(store.path(5), store.finished_path(5))
    fresh_p, fresh_o = _handler_state(seed=1)
    periodic = store.load(3, params_like=fresh_p, opt_state_like=fresh_o)
    assert not periodic.finished and periodic.best is None
    final = store.load(5, params_like=fresh_p, opt_state_like=fresh_o)
    assert final.finished and final.best is not None
    for want, got in ((params, final.params), (best, final.best)):
        leaves = jax.tree_util.tree_leaves
        for a, b in zip(leaves(want), leaves(got), strict=True):
            assert np.array_equal(np.asarray(a), b)


def test_groups_tried_summarises_the_tuners_path_by_count_in_first_run_order():
    from tandem.parties.split.process.standalone import groups_tried

    path = [(4, 2.0), (1, 1.0), (1, 3.0), (2, 0.5), (1, 2.0), (2, 0.7)]
    assert groups_tried(path) == {
        "4": {"batches": 1, "mean_s": 2.0},
        "1": {"batches": 3, "mean_s": 2.0},
        "2": {"batches": 2, "mean_s": 0.6},
    }
    assert list(groups_tried(path)) == ["4", "1", "2"]
    assert groups_tried([]) == {}


def test_groups_path_runs_the_tuners_counts_in_batch_order():
    from tandem.parties.split.process.standalone import groups_path

    path = [(4, 2.0), (4, 0.5), (1, 0.7), (2, 0.4), (2, 0.4), (1, 0.7), (2, 0.4)]
    assert groups_path(path) == [[4, 2, 1.25], [1, 1, 0.7], [2, 2, 0.4], [1, 1, 0.7], [2, 1, 0.4]]
    assert groups_path([]) == []
