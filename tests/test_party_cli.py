"""`tandem party --config`: leader and follower as two real OS processes over HTTP on loopback.

Every case starts ``python -m tandem.parties.cli party`` twice (see `party_helpers.Job`), but
the chunked-messages one, which checks what goes over HTTP and runs both parties' `run_party`
in this process (`Job.run_all`). The reference run (module fixture) is the uninterrupted
training every resumed run must match bit for bit (same seed, fixed ``groups = 2``).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from party_helpers import Job, healthy, incarnation, metrics, wait_until

pytestmark = pytest.mark.slow
TOTAL = 16  # 64 rows / batch 16 = 4 batches per epoch, 4 epochs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = Job(tmp_path_factory.mktemp("reference"))
    results = job.run_both()
    return job, results


def test_full_run_trains_evaluates_exports(reference):
    job, results = reference
    (rc_l, lead, err_l), (rc_f, fol, err_f) = results["leader"], results["follower"]
    assert rc_l == 0 and rc_f == 0, err_l[-2000:] + err_f[-2000:]
    assert lead["status"] == fol["status"] == "done"
    assert lead["spec_hash"] == fol["spec_hash"] and len(lead["spec_hash"]) == 64
    assert lead["resumed_from"] == fol["resumed_from"] == 0
    assert lead["epochs"] == 4 and lead["n_groups"] == 2
    assert lead["groups_tried"] == {}  # a fixed count: the tuner ran nothing
    assert 0.0 <= lead["test_accuracy"] <= 1.0 and np.isfinite(lead["test_loss"])
    assert lead["bytes_sent"]["follower"] == fol["bytes_received"]["leader"] > 0
    # each party exported only its own stages, stamped with the same run id
    assert {k.split("/")[1] for k in job.exported("leader")} == {"bottom_leader", "top"}
    assert {k.split("/")[1] for k in job.exported("follower")} == {"bottom_follower"}
    from tandem.parties.export import read_description

    descs = [
        read_description(job.folder / "out" / r / f"{r}.safetensors")
        for r in ("leader", "follower")
    ]
    assert descs[0]["training"] == descs[1]["training"]
    # checkpoints every 2 batches, the newest 2 kept, same steps on both sides
    assert job.checkpoints("leader") == job.checkpoints("follower") == [TOTAL - 2, TOTAL]


async def test_chunked_messages_over_http_train_the_same_model(tmp_path, reference):
    """``[train] chunks = 3`` on the leader only: the follower takes it from each batch command
    (sending each group's activation in 3 parts, joining 3 gradient parts), the spec records
    it, and the parameters equal the reference run's up to float reassociation. Both parties
    run in this process, over HTTP (what is checked is their messages, not their processes)."""
    ref, results = reference
    job = Job(tmp_path)
    job.cfg["leader"]["train"]["chunks"] = 3
    got = await job.run_all()
    for role in ("leader", "follower"):
        assert isinstance(got[role], dict) and got[role]["status"] == "done", got[role]
    assert got["leader"]["spec_hash"] == got["follower"]["spec_hash"]
    assert got["leader"]["spec_hash"] != results["leader"][1]["spec_hash"]  # chunks recorded
    for role in ("leader", "follower"):
        have, want = job.exported(role), ref.exported(role)
        assert have.keys() == want.keys()
        for name in want:
            np.testing.assert_allclose(
                have[name], want[name], rtol=1e-4, atol=1e-6, err_msg=f"{role} {name}"
            )


def test_alignment_is_part_of_the_agreed_spec(reference):
    """The follower stores its rows in reverse; `data.aligned` (the `tandem align --out` CSVs)
    lines them up, and the spec records the intersection size and commitment."""
    _, results = reference
    lead, fol = results["leader"][1], results["follower"][1]
    assert lead["alignment"] == fol["alignment"]
    assert lead["alignment"]["size"] == 64 and len(lead["alignment"]["commitment"]) == 64


def _assert_same_params(job: Job, ref: Job) -> None:
    for role in ("leader", "follower"):
        got, want = job.exported(role), ref.exported(role)
        assert got.keys() == want.keys()
        for name in want:  # bit-for-bit: same ops on the same values in the same order
            assert np.array_equal(got[name], want[name]), f"{role} {name} differs"


def _slow_link(job: Job) -> None:
    for role in ("leader", "follower"):
        job.cfg[role]["link"] = {"latency": 0.03}


def _fast_link(job: Job) -> None:
    for role in ("leader", "follower"):
        job.cfg[role].pop("link", None)


@pytest.mark.parametrize("first", ["follower", "leader"])
def test_kill9_mid_epoch_then_restart_matches_uninterrupted_run(tmp_path, reference, first):
    ref, _ = reference
    job = Job(tmp_path, every=3)  # checkpoints at 3, 6, 9, ...: mostly mid-epoch
    for role in ("leader", "follower"):
        job.cfg[role]["checkpoint"]["keep"] = 3
        job.cfg[role]["security"]["peer_timeout"] = 2.0
    _slow_link(job)
    procs = {r: job.start(r) for r in ("follower", "leader")}
    wait_until(
        lambda: max(job.checkpoints("follower"), default=0) >= 6,
        90,
        "the follower's checkpoint at step 6",
    )
    procs[first].kill9()
    # the survivor gets no goodbye (kill -9); it finds the peer gone (peer_timeout, or its
    # sends' retry_timeout) and stops by itself, saying how to resume
    rc, _, err = procs["leader" if first == "follower" else "follower"].finish(timeout=60)
    assert rc != 0 and "restart every party" in err, err[-3000:]
    leader_steps, follower_steps = job.checkpoints("leader"), job.checkpoints("follower")
    assert max(follower_steps) < TOTAL, "training finished before the kill"
    # the window: the follower died before writing the step the leader already saved (made
    # certain by deleting its newest file; also done when that step ends an epoch, so that
    # the resume point is mid-epoch: steps are multiples of 3, epochs 4 batches long)
    newest = max(follower_steps)
    if newest == max(leader_steps) or newest % 4 == 0:
        os.unlink(job.folder / "ckpt" / "follower" / f"step-{newest:09d}.safetensors")
    common = max(set(leader_steps) & set(job.checkpoints("follower")))
    assert common % 4 and common < max(leader_steps + follower_steps)  # one party is ahead
    _fast_link(job)
    results = job.run_both(tag="-resumed")
    for role in ("leader", "follower"):
        rc, out, err = results[role]
        assert rc == 0, err[-3000:]
        assert out["status"] == "done" and out["resumed_from"] == common
    # the stale newer checkpoint of the leader was discarded and rewritten by the replay
    assert job.checkpoints("leader") == job.checkpoints("follower") == [9, 12, 15]
    _assert_same_params(job, ref)


@pytest.mark.parametrize("who", ["leader", "follower"])
def test_sigterm_stops_cleanly_with_a_usable_checkpoint(tmp_path, who):
    job = Job(tmp_path)
    _slow_link(job)
    procs = {r: job.start(r) for r in ("follower", "leader")}
    wait_until(
        lambda: max(job.checkpoints("leader"), default=0) >= 2, 90, "the leader's first checkpoint"
    )
    procs[who].signal(signal.SIGTERM)
    results = {r: p.finish() for r, p in procs.items()}
    for role in ("leader", "follower"):
        rc, out, err = results[role]
        assert rc == 0, err[-3000:]
        assert out["status"] == "stopped", out
    step = results["leader"][1]["checkpoint"]
    assert step == results["follower"][1]["checkpoint"] == results["leader"][1]["step"]
    assert 2 <= step < TOTAL
    if who == "follower":
        assert results["leader"][1]["detail"] == "follower asked to stop"
    # usable: both parties hold that step for the agreed spec, and it loads into their models
    # (that resuming from a common checkpoint is exact is what the kill -9 tests check)
    for role in ("leader", "follower"):
        _load_checkpoint(job, role, step, results[role][1]["spec_hash"])


def _load_checkpoint(job: Job, role: str, step: int, spec_hash: str) -> None:
    import optax

    from party_helpers import F_FOLLOWER, F_LEADER
    from tandem.engine.kernels import get_loss
    from tandem.parties.split.checkpoint import CheckpointStore
    from tandem.parties.split.process.party_config import load_party_config, models_from_widths
    from tandem.parties.split.stages import StageHandler

    cfg = load_party_config(job.path(role))
    topo = cfg.topology()
    models = models_from_widths(
        topo, cfg.stage_widths({"leader": F_LEADER, "follower": F_FOLLOWER})
    )
    handler = StageHandler(
        topo, role, models, optax.adam(0.01), loss=get_loss("binary") if role == "leader" else None
    )
    store = CheckpointStore(job.folder / "ckpt" / role, party=role)
    restored = store.load(
        step, params_like=handler.params, opt_state_like=handler.opt_state, spec_hash=spec_hash
    )
    assert restored.step == step
    if role == "leader":  # data cursor: the epoch and the batches done in it
        assert restored.cursor == {"epoch": (step - 1) // 4, "batch": (step - 1) % 4 + 1}


def test_wrong_secret_is_refused_with_401(tmp_path):
    job = Job(tmp_path)
    job.cfg["follower"]["security"]["secret"] = "another-secret"
    follower = job.start("follower")
    leader = job.start("leader")
    rc, out, err = leader.finish()
    assert rc == 1 and out is None
    assert "refused the frame (401)" in err and "same secret" in err, err[-2000:]
    # the follower refused the leader's frames (401), warned naming it, and found out that
    # the secrets differ: it stops by itself (tests/test_party_abort.py)
    rc, out, err = follower.finish()
    assert rc == 1 and out is None, err[-2000:]
    assert "refused a request from its peer 'leader' for authentication" in err, err[-2000:]


def test_spec_and_alignment_mismatch_refused_at_negotiation(tmp_path):
    job = Job(tmp_path)
    job.cfg["follower"]["model"]["cut"] = 6
    from party_helpers import ROWS, write_aligned

    # the follower aligned on other ids: same size, different commitment
    write_aligned(
        tmp_path / "other_aligned.csv",
        [(ROWS - 1 - i, f"c{i}" if i else "zz") for i in range(ROWS)],
    )
    job.cfg["follower"]["data"]["aligned"] = "other_aligned.csv"
    results = job.run_both()
    for role in ("leader", "follower"):
        rc, out, err = results[role]
        assert rc == 1 and out is None, err[-2000:]
        assert "stage 'bottom_follower': 'follower' has out_dim 6 but the spec says 4" in err
        assert "aligned rows differ" in err
    assert "refused the task spec" in results["follower"][2]
    assert not job.checkpoints("leader")


# -- malformed requests against a live party ----------------------------------------------------
HEADER_NAMES = [
    "X-Tandem-Sender",
    "X-Tandem-Incarnation",
    "X-Tandem-Channel",
    "X-Tandem-Msg-Id",
    "X-Tandem-Chunk",
    "X-Tandem-Chunks",
    "X-Tandem-Offset",
    "X-Tandem-Total",
    "X-Tandem-Spec",
    "X-Tandem-Reply-To",
    "X-Tandem-Signature",
]
printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
numbers = st.one_of(st.integers(-5, 2**70).map(str), printable)


@st.composite
def requests(draw):
    """(headers, body, sign): random routing headers, some signed with the real secret so
    they get past authentication to the header, chunk and codec checks."""
    from tandem.transports import codec
    from tandem.transports.base import Frame

    signed = draw(st.booleans())
    headers = {
        name: draw(
            numbers
            if "Id" in name or "Chunk" in name or "Offset" in name or "Total" in name
            else printable
        )
        for name in draw(st.lists(st.sampled_from(HEADER_NAMES), unique=True))
    }
    if signed:  # a known sender and a single chunk: valid routing, bad content
        headers.update(
            {
                "X-Tandem-Sender": "leader",
                "X-Tandem-Chunk": "0",
                "X-Tandem-Chunks": "1",
                "X-Tandem-Offset": "0",
                "X-Tandem-Msg-Id": str(draw(st.integers(0, 3))),
                "X-Tandem-Incarnation": draw(st.text("0123456789abcdef", min_size=1, max_size=16)),
            }
        )
        headers.setdefault("X-Tandem-Channel", draw(st.sampled_from(["ctl", "fuzz"])))
    kind = draw(st.sampled_from(["random", "truncated", "foreign"]))
    arrays = (np.zeros((2, 3), np.float32),)
    good = codec.encode(
        Frame(sender="mallory", channel="ctl", meta={"cmd": "propose"}, arrays=arrays)
    )
    body = {
        "random": draw(st.binary(max_size=300)),
        "truncated": good[: draw(st.integers(0, len(good) - 1))],
        "foreign": good,
    }[kind]  # a well-formed frame whose header disagrees
    if signed:
        headers["X-Tandem-Total"] = str(len(body))
    return headers, body, signed


def test_malformed_requests_get_4xx_and_the_party_still_trains(tmp_path):
    from tandem.transports import auth

    job = Job(tmp_path, epochs=1)
    follower = job.start("follower")
    wait_until(
        lambda: healthy(job.url("follower")) or follower.popen.poll() is not None,
        60,
        "the follower's /healthz",
    )
    assert follower.popen.poll() is None, follower.err.read_text()[-2000:]
    port = job.ports["follower"]
    to = incarnation(job.url("follower"), "follower", "leader")  # what signatures bind to
    statuses = []

    @settings(
        max_examples=examples(60),
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(requests())
    def fuzz(req):
        headers, body, signed = req
        # HTTP strips the ends of header values: a signed request must sign what arrives
        headers = {k: v.strip() for k, v in headers.items()} if signed else dict(headers)
        if signed:
            auth.sign(
                b"s3cret",
                "POST",
                "/tandem/v1/frame",
                headers,
                auth.body_digest([body]),
                receiver="follower",
                to=to,
            )
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("POST", "/tandem/v1/frame", body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
        finally:
            conn.close()
        statuses.append(resp.status)
        assert 400 <= resp.status < 500, (resp.status, headers, body[:60])

    fuzz()
    assert follower.popen.poll() is None, "the follower died under malformed requests"
    assert 401 in statuses and any(s != 401 for s in statuses)  # both layers were reached
    text = metrics(job.url("follower"), "follower", "leader")
    assert 'reason="malformed"' in text and "tandem_party_n_groups" not in text  # no spec yet
    leader = job.start("leader")
    rc_l, out_l, err_l = leader.finish()
    rc_f, out_f, err_f = follower.finish()
    assert rc_l == 0 and rc_f == 0, err_l[-2000:] + err_f[-2000:]
    assert out_l["status"] == out_f["status"] == "done"


def test_grace_exceeded_aborts_the_batch_cleanly(tmp_path):
    """grace = 0: SIGTERM aborts the leader's current batch (nothing saved for it, exit 0),
    and the follower sees the leader leave and says how to resume. (That a restart from the
    remaining checkpoints is exact is what the kill -9 tests check.)"""
    job = Job(tmp_path)
    _slow_link(job)
    for role in ("leader", "follower"):
        job.cfg[role]["grace"] = 0.0
    procs = {r: job.start(r) for r in ("follower", "leader")}
    wait_until(
        lambda: max(job.checkpoints("leader"), default=0) >= 2, 90, "the leader's first checkpoint"
    )
    procs["leader"].signal(signal.SIGTERM)
    (rc_l, lead, err_l), (rc_f, fol, err_f) = (procs[r].finish() for r in ("leader", "follower"))
    assert rc_l == 0, err_l[-2000:]
    if lead["status"] == "aborted":  # the usual case: the signal lands inside a batch
        assert rc_f == 1 and "a peer left during training" in err_f, err_f[-2000:]
        assert "restart every party to resume" in err_f
    else:  # it landed exactly between two batches: a clean stop
        assert lead["status"] == "stopped" and rc_f == 0, (lead, err_f[-2000:])
    assert lead["step"] < TOTAL
    assert lead["checkpoint"] == max(job.checkpoints("leader"))
    assert set(job.checkpoints("leader")) & set(job.checkpoints("follower"))


def test_restart_of_a_finished_job_trains_nothing_and_exports_the_same(tmp_path):
    """``every`` = 3 does not divide the 16 steps: the last periodic checkpoint is step 15.
    The finished job saved a finished checkpoint at 16 (holding the best epoch's parameters
    beside the last ones); restarting both parties without ``--fresh`` trains no batch and
    exports bit for bit what the first run exported, and the JSON lines say so."""
    job = Job(tmp_path, every=3)
    job.cfg["leader"]["train"].update(patience=10, learning_rate=0.3)  # restore_best: default
    first = job.run_both()
    for role in ("leader", "follower"):
        rc, out, err = first[role]
        assert rc == 0 and out["status"] == "done", err[-3000:]
        assert out["resumed"] == "fresh" and out["batches_trained"] == TOTAL
        assert out["compile_ahead_seconds"] > 0  # the prepare step compiled update and zeros
    lead = first["leader"][1]
    assert lead["early_stopping"]["parameters"] == "best"
    # the newest 2 periodic files, and beside them (another name) the finished one
    assert job.checkpoints("leader") == job.checkpoints("follower") == [12, 15]
    from tandem.parties.split.checkpoint import CheckpointStore

    for role in ("leader", "follower"):
        store = CheckpointStore(job.folder / "ckpt" / role, party=role)
        assert store.finished() == {TOTAL} and store.all_steps() == [12, 15, TOTAL]
        assert (job.folder / "ckpt" / role / f"finished-{TOTAL:09d}.safetensors").exists()
        # the best epoch (seeded: 1) was not the last: the finished file holds both sets
        assert lead["best"]["epoch"] < 3 and "best" in store.read_meta(TOTAL)["structure"]
    exported = {r: job.exported(r) for r in ("leader", "follower")}
    files = {r: (job.folder / "out" / r / f"{r}.safetensors").read_bytes() for r in exported}

    again = job.run_both(tag="-again")
    for role in ("leader", "follower"):
        rc, out, err = again[role]
        assert rc == 0 and out["status"] == "done", err[-3000:]
        assert out["resumed"] == "finished" and out["batches_trained"] == 0, out
        assert out["resumed_from"] == out["step"] == TOTAL and out["checkpoint"] == TOTAL
        got = job.exported(role)
        assert got.keys() == exported[role].keys()
        for name, want in exported[role].items():
            assert np.array_equal(got[name], want), f"{role} {name} differs"
        path = job.folder / "out" / role / f"{role}.safetensors"
        assert path.read_bytes() == files[role], f"{role}'s export file changed"
    again_lead = again["leader"][1]
    for key in ("test_loss", "test_accuracy", "best", "early_stopping", "validation"):
        assert again_lead[key] == lead[key], key
    assert job.checkpoints("leader") == job.checkpoints("follower") == [12, 15]


def test_a_rerun_of_an_auto_job_starts_at_the_count_the_last_run_settled_on(tmp_path):
    """``groups = "auto"``: the leader remembers the settled count in its compile cache
    folder; a rerun of the job (``--fresh``: no checkpoint) starts there instead of
    searching, and a restart of the finished job takes its checkpoint's count."""
    job = Job(tmp_path, epochs=15, every=1000)  # 60 batches: settled, no re-check yet
    job.cfg["leader"]["train"]["groups"] = "auto"
    for role in ("leader", "follower"):
        job.cfg[role]["checkpoint"]["compile_cache"] = str(tmp_path / f"cache-{role}")
    lead = job.run_both("_first")["leader"][1]
    assert lead["status"] == "done" and lead["groups_from"] == "search"
    assert list(lead["groups_tried"])[0] == "4"  # the tuner's first count, then its search
    remembered = json.loads((tmp_path / "cache-leader" / "tuned-groups.json").read_text())
    ((n, interval, wall),) = [tuple(e.values()) for e in remembered.values()]
    assert n == lead["n_groups"] and interval == 50 and wall > 0  # settled once, its wall
    assert not (tmp_path / "cache-follower" / "tuned-groups.json").exists()  # the leader's

    restart = job.run_both("_restart")["leader"][1]  # its finished checkpoint's count
    assert restart["resumed"] == "finished" and restart["groups_from"] == "checkpoint"
    assert restart["n_groups"] == n

    job.args = {"leader": ["--fresh"], "follower": ["--fresh"]}
    again = job.run_both("_again")["leader"][1]
    assert again["status"] == "done" and again["groups_from"] == "remembered"
    assert list(again["groups_tried"])[0] == str(n)  # no search: it starts at n
    # at n at least until its wall is compared with the remembered one (the loading batch
    # and 2 * samples; a drift beyond 10 % then re-checks at once, else none comes in 60)
    assert again["groups_tried"][str(n)]["batches"] >= 1 + 2 * 4


async def test_resume_refuses_a_checkpoint_saved_for_another_model_of_the_same_shapes(tmp_path):
    """The follower's bottom stage loses its last ReLU between runs: its parameters keep their
    shapes (so the spec and the leaves still fit) but the checkpoint was trained for another
    model; the restart is refused, naming the stage and the fix, instead of loading it."""
    job = Job(tmp_path, epochs=1)
    first = await job.run_all()
    assert all(r["status"] == "done" for r in first.values()), first
    job.cfg["follower"]["model"]["bottom_follower"] = {
        "kind": "mlp",
        "hidden": [8],
        "out": 4,
        "activate_last": False,
    }
    with pytest.raises(ExceptionGroup) as info:
        await job.run_all()
    text = " ".join(str(e) for e in info.value.exceptions)
    assert "bottom_follower" in text and "another model" in text and "--fresh" in text, text


async def test_changed_settings_stop_the_parties_instead_of_deleting_their_checkpoints(tmp_path):
    """More epochs asked of a finished job change the task spec: no checkpoint can resume
    under it. The parties stop, naming the changed key and the fix, and keep every checkpoint
    (the agreement would otherwise start over and delete them); with ``--fresh`` they do
    start over."""
    from tandem.parties.split.process.party_config import load_party_config
    from tandem.parties.split.process.standalone import run_party

    job = Job(tmp_path, epochs=1)
    first = await job.run_all()
    assert all(r["status"] == "done" for r in first.values()), first
    held = {role: job.checkpoints(role) for role in ("leader", "follower")}
    job.cfg["leader"]["train"]["epochs"] = 2
    with pytest.raises(ExceptionGroup) as info:
        await job.run_all()
    text = " ".join(str(e) for e in info.value.exceptions)
    assert "[epochs] 1 then, 2 now" in text and "--fresh" in text, text
    assert {role: job.checkpoints(role) for role in held} == held and all(held.values())
    cfgs = {r: load_party_config(job.path(r)) for r in ("follower", "leader")}
    async with asyncio.TaskGroup() as tg:
        tasks = {r: tg.create_task(run_party(c, fresh=True)) for r, c in cfgs.items()}
    assert all(t.result()["status"] == "done" for t in tasks.values())
    assert tasks["leader"].result()["epochs_done"] == 2


async def test_a_stop_at_an_epochs_last_batch_still_validates_that_epoch_on_resume(
    tmp_path, monkeypatch
):
    """The leader is stopped (as by SIGTERM) during epoch 0's last batch: it checkpoints step 4
    at cursor (0, 4) and stops before validating epoch 0. The resumed run validates epoch 0
    before training epoch 1, so the history (and the early stopping built from it) holds
    every epoch, as the uninterrupted run's does."""
    import asyncio

    from tandem.parties.split.checkpoint import CheckpointStore
    from tandem.parties.split.process.party_config import load_party_config
    from tandem.parties.split.process.standalone import run_party

    job = Job(tmp_path)
    job.cfg["leader"]["train"]["patience"] = 10
    job.write()
    stop = asyncio.Event()
    save = CheckpointStore.save

    def save_then_stop(self, step, **kwargs):
        path = save(self, step, **kwargs)
        if self.party == "leader" and step == 4:  # epoch 0 has 4 batches
            stop.set()
        return path

    async def run(leader_stop):
        cfgs = {r: load_party_config(job.path(r)) for r in ("follower", "leader")}
        async with asyncio.TaskGroup() as tg:
            tasks = {
                r: tg.create_task(run_party(c, stop=leader_stop if r == "leader" else None))
                for r, c in cfgs.items()
            }
        return {r: t.result() for r, t in tasks.items()}

    monkeypatch.setattr(CheckpointStore, "save", save_then_stop)
    first = await run(stop)
    assert first["leader"]["status"] == "stopped" and first["leader"]["checkpoint"] == 4
    monkeypatch.setattr(CheckpointStore, "save", save)
    again = await run(None)
    lead = again["leader"]
    assert lead["status"] == "done" and lead["resumed_from"] == 4 and lead["step"] == TOTAL
    history = (job.folder / "ckpt" / "leader" / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in history] == [0, 1, 2, 3]
    assert lead["epochs_done"] == 4
