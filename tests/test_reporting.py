"""What a split-learning run reports (`tandem.parties.split.reporting`, `party_trace`): validation
after every epoch, early stopping with the best epoch's parameters back on every party, the
JSONL history (trimmed on resume), TensorBoard event files, and per-party traces.

In-process parties over the memory transport; `test_party_reports_*` runs `tandem party`."""

from __future__ import annotations

import asyncio
import json
import struct

import numpy as np
import pytest

from tandem.engine.kernels import mlp_stage
from tandem.engine.topology import leader_follower
from tandem.errors import ConfigError, MissingExtraError
from tandem.parties.split import SplitConfig, SplitParty
from tandem.parties.split.metrics import task_metrics
from tandem.parties.split.reporting import (
    EarlyStopping,
    ReportConfig,
    Reporter,
    Validation,
    monitor_key,
)
from tandem.transports.memory import MemoryNetwork

ROWS, VAL_ROWS = 48, 20


# -- pure parts ----------------------------------------------------------------------------------
def test_monitor_names_take_an_optional_val_prefix_and_imply_the_direction():
    assert monitor_key("auc", "binary") == monitor_key("val_auc", "binary") == "val_auc"
    assert monitor_key("train_loss", "mse") == "train_loss"
    assert [ReportConfig(monitor=monitor_key(m, "binary")).mode for m in ("loss", "ks")] == [
        "min",
        "max",
    ]
    assert ReportConfig(monitor=monitor_key("rmse", "mse")).mode == "min"
    assert ReportConfig(monitor=monitor_key("r2", "mse")).mode == "max"
    with pytest.raises(ConfigError) as info:
        monitor_key("auc", "softmax")
    message = str(info.value)
    assert "'auc' is not a value of a 'softmax' run" in message
    assert "val_macro_f1" in message and "train_loss" in message and "val_auc" not in message
    with pytest.raises(ConfigError, match="patience must be >= 1"):
        ReportConfig(patience=0)


def test_early_stopping_counts_epochs_without_improvement():
    state = EarlyStopping("max", min_delta=0.01)
    seen = []
    for epoch, value in enumerate([0.5, 0.505, 0.6, None, float("nan"), 0.7, 0.69]):
        improved = state.improves(value)
        state = state.observe(epoch, value)
        seen.append((improved, state.best_epoch, state.wait))
    assert seen == [
        (True, 0, 0),
        (False, 0, 1),  # within min_delta
        (True, 2, 0),
        (False, 2, 1),  # undefined
        (False, 2, 2),  # not finite
        (True, 5, 0),
        (False, 5, 1),
    ]
    assert state.exhausted(1) and not state.exhausted(2) and not state.exhausted(None)
    low = EarlyStopping("min").observe(0, 1.0).observe(1, 0.5)
    assert (low.best, low.best_epoch) == (0.5, 1)


# -- in-process parties --------------------------------------------------------------------------
def _job(*, learning_rate: float = 0.05, groups: int = 2):
    """A leader (labels, 3 columns) and a follower (2 columns) with train and test rows."""
    rng = np.random.default_rng(0)
    n = ROWS + VAL_ROWS
    xl, xf = rng.normal(size=(n, 3)).astype("f4"), rng.normal(size=(n, 2)).astype("f4")
    y = (xl[:, 0] - xf[:, 1] + 0.3 * rng.normal(size=n) > 0).astype("f4")
    topo = leader_follower()
    models = {
        "bottom_leader": mlp_stage([3], [6], 4),
        "bottom_follower": mlp_stage([2], [6], 4),
        "top": mlp_stage([4, 4], [6], 1, activate_last=False),
    }
    cfg = SplitConfig(batch_size=16, groups=groups, learning_rate=learning_rate, seed=1)
    net = MemoryNetwork()

    def split(x):
        return {"train": x[:ROWS], "test": x[ROWS:]}

    leader = SplitParty(
        "leader",
        topo,
        models,
        net.endpoint("leader"),
        datasets=split(xl),
        labels=split(y),
        config=cfg,
    )
    follower = SplitParty(
        "follower", topo, models, net.endpoint("follower"), datasets=split(xf), config=cfg
    )
    return leader, follower


async def _run(leader, follower, lead):
    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        result = await lead()
        await leader.stop()
    return result


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_every_epoch_is_validated_and_written_to_the_history(tmp_path):
    leader, follower = _job()
    history = tmp_path / "run" / "history.jsonl"
    reporter = Reporter(leader, ReportConfig(history=str(history)), Validation("test"))

    async def lead():
        async with reporter.opened(0):
            await leader.fit(3, after_epoch=reporter.after_epoch)
            summary = await reporter.finish()
        return summary, await leader.evaluate("test")

    summary, final = await _run(leader, follower, lead)
    records = _records(history)
    assert [r["epoch"] for r in records] == [0, 1, 2]
    names = ("loss", "log_loss", "accuracy", "auc", "f1", "ks")
    for r, epoch in zip(records, leader.history, strict=True):
        assert r["train_loss"] == pytest.approx(epoch.loss)
        assert r["n_groups"] == 2 and r["batches"] == 3 and r["seconds"] > 0
        assert {f"val_{m}" for m in names} <= r.keys() and r["val_seconds"] > 0
        assert r["val_auc"] == epoch.validation["auc"]
    # validating changes nothing: the last epoch's metrics are those of the trained model
    assert records[-1]["val_auc"] == pytest.approx(final["auc"], abs=1e-12)
    assert records[-1]["val_loss"] == pytest.approx(final["loss"], rel=1e-6)
    # and does not move the checkpoint step: 3 epochs of 3 training batches
    assert leader.step == follower.step == 9
    assert leader.batches_done == follower.batches_done == 9 + 3 + 1
    losses = [r["val_loss"] for r in records]
    best = int(np.argmin(losses))
    assert summary["best"]["monitor"] == "val_loss" and summary["best"]["epoch"] == best
    assert summary["best"]["value"] == pytest.approx(losses[best])
    assert summary["validation"]["epoch"] == 2 and summary["validation"]["rows"] == VAL_ROWS
    assert summary["epochs_done"] == 3 and "early_stopping" not in summary
    assert [r["improved"] for r in records][best] is True


async def test_validation_takes_given_rows_of_a_dataset():
    leader, follower = _job()
    rows = np.array([5, 0, 17, 3, 11])

    async def lead():
        return await leader.evaluate("test", rows=rows), leader.predictions

    metrics, outputs = await _run(leader, follower, lead)
    assert metrics == task_metrics(outputs, leader.labels["test"][rows], "binary")
    assert outputs.shape == (5, 1)
    leader, follower = _job()

    async def beyond():
        return await leader.evaluate("test", rows=np.array([VAL_ROWS]))

    with pytest.raises(ExceptionGroup) as info:
        await _run(leader, follower, beyond)
    assert "reach row 20 of 'test', which has 20 rows" in str(info.value.exceptions[0])


async def _params_after(epochs: int):
    leader, follower = _job(learning_rate=0.3)

    async def lead():
        await leader.fit(epochs)

    await _run(leader, follower, lead)
    return leader.params, follower.params


def _equal(a, b) -> bool:
    import jax

    return all(
        np.array_equal(x, y)
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


async def test_early_stopping_puts_the_best_epochs_parameters_back_on_every_party(tmp_path):
    """Monitoring accuracy with min_delta = 1 only the first epoch can improve: patience 2 stops
    after epoch 2, and both parties end with the parameters they had after epoch 0, bit for
    bit (a run of exactly one epoch gives those)."""
    leader, follower = _job(learning_rate=0.3)
    config = ReportConfig(
        monitor="val_accuracy", patience=2, min_delta=1.0, history=str(tmp_path / "h.jsonl")
    )
    reporter = Reporter(leader, config, Validation("test"))

    async def lead():
        async with reporter.opened(0):
            await leader.fit(6, after_epoch=reporter.after_epoch)
            return await reporter.finish()

    summary = await _run(leader, follower, lead)
    assert [r["epoch"] for r in _records(tmp_path / "h.jsonl")] == [0, 1, 2]
    assert summary["early_stopping"] == {"patience": 2, "stopped": True, "parameters": "best"}
    assert summary["best"]["epoch"] == 0 and summary["best"]["mode"] == "max"
    assert summary["best"]["validation"]["epoch"] == 0
    want_leader, want_follower = await _params_after(1)
    assert _equal(leader.params, want_leader) and _equal(follower.params, want_follower)
    last_leader, _ = await _params_after(3)
    assert not _equal(leader.params, last_leader)  # the training did move on


async def test_restore_best_false_keeps_the_last_epoch(tmp_path):
    leader, follower = _job(learning_rate=0.3)
    config = ReportConfig(monitor="val_accuracy", patience=1, min_delta=1.0, restore_best=False)
    reporter = Reporter(leader, config, Validation("test"))

    async def lead():
        async with reporter.opened(0):
            await leader.fit(6, after_epoch=reporter.after_epoch)
            return await reporter.finish()

    summary = await _run(leader, follower, lead)
    assert summary["early_stopping"]["parameters"] == "last" and len(leader.history) == 2
    assert follower.kept_params is None
    want_leader, want_follower = await _params_after(2)
    assert _equal(leader.params, want_leader) and _equal(follower.params, want_follower)


async def test_a_resumed_run_keeps_earlier_epochs_and_rebuilds_the_best(tmp_path):
    history = tmp_path / "history.jsonl"
    lines = [
        {"epoch": e, "train_loss": 1.0, "val_loss": v, "n_groups": 2}
        for e, v in enumerate([0.9, 0.4, 0.6, 0.3])
    ]
    history.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"epoch": 4, "tra')
    leader, _ = _job()
    reporter = Reporter(leader, ReportConfig(history=str(history), patience=5), Validation("test"))
    async with reporter.opened(3):  # epochs 3 and later are replayed
        pass
    assert [r["epoch"] for r in _records(history)] == [0, 1, 2]
    assert (reporter.state.best_epoch, reporter.state.best, reporter.state.wait) == (1, 0.4, 1)
    fresh = Reporter(leader, ReportConfig(history=str(history)), None)
    async with fresh.opened(0):
        pass
    assert history.read_text() == ""


def test_early_stopping_on_a_validation_metric_needs_validation_rows():
    leader, _ = _job()
    with pytest.raises(ConfigError, match='monitor = "train_loss"'):
        Reporter(leader, ReportConfig(monitor="val_auc", patience=2), None)
    Reporter(leader, ReportConfig(monitor="train_loss", patience=2), None)


# -- TensorBoard ---------------------------------------------------------------------------------
def _crc_ok(data: bytes, masked: int) -> bool:
    from tensorboardX.crc32c import crc32c

    crc = crc32c(data)
    return masked == ((((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def read_scalars(folder) -> dict[str, dict[int, float]]:
    """Every scalar of the event files in ``folder``: the TFRecord framing (length, masked
    CRC-32C of the length, data, masked CRC-32C of the data) checked record by record."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, dict[int, float]] = {}
    files = sorted(folder.glob("events.out.tfevents.*"))
    assert files, f"no event file in {folder}"
    for path in files:
        raw, pos = path.read_bytes(), 0
        while pos < len(raw):
            header = raw[pos : pos + 8]
            (length,) = struct.unpack("<Q", header)
            (length_crc,) = struct.unpack("<I", raw[pos + 8 : pos + 12])
            data = raw[pos + 12 : pos + 12 + length]
            (data_crc,) = struct.unpack("<I", raw[pos + 12 + length : pos + 16 + length])
            assert _crc_ok(header, length_crc) and _crc_ok(data, data_crc), path
            pos += 16 + length
            event = Event.FromString(data)
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


async def test_tensorboard_event_files_hold_every_epochs_scalars(tmp_path):
    leader, follower = _job()
    board = tmp_path / "tb"
    config = ReportConfig(history=str(tmp_path / "h.jsonl"), tensorboard=str(board))
    reporter = Reporter(leader, config, Validation("test"))

    async def lead():
        async with reporter.opened(0):
            await leader.fit(2, after_epoch=reporter.after_epoch)
            return await reporter.finish()

    summary = await _run(leader, follower, lead)
    assert summary["tensorboard"] == str(board)
    scalars = read_scalars(board)
    records = _records(tmp_path / "h.jsonl")
    for tag, key in (("train/loss", "train_loss"), ("val/auc", "val_auc"), ("val/ks", "val_ks")):
        assert sorted(scalars[tag]) == [0, 1]
        for r in records:
            assert scalars[tag][r["epoch"]] == pytest.approx(r[key], rel=1e-6)
    assert scalars["n_groups"] == {0: 2.0, 1: 2.0}


def test_tensorboard_without_its_extra_says_how_to_install_it(monkeypatch):
    from tandem.parties.split.reporting import report_config

    monkeypatch.setitem(__import__("sys").modules, "tensorboardX", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'tandem\[tensorboard\]'"):
        report_config({}, {"tensorboard": "tb"}, loss="binary", default_history=None)


# -- traces --------------------------------------------------------------------------------------
async def test_batch_trace_records_a_window_of_training_batches(tmp_path):
    pytest.importorskip("matplotlib")
    from tandem.parties.split.process.party_trace import BatchTrace

    leader, follower = _job()
    traces = {p.name: BatchTrace(str(tmp_path), p, batches=2) for p in (leader, follower)}

    async def on_batch(meta):
        if meta.get("mode") == "train":
            traces["follower"].after_batch()

    async def after_batch(epoch, done):
        traces["leader"].after_batch()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve(on_batch=on_batch))
        await leader.fit(2, after_batch=after_batch)  # 6 batches: the 2nd and 3rd are traced
        await leader.stop()
    for name, trace in traces.items():
        written = await trace.write()
        assert written["trace"]["batches"] == 2
        chrome = json.loads((tmp_path / f"trace_{name}.json").read_text())
        ops = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
        # 2 batches x 2 groups: each party runs 2 forward ops per batch, and an update each
        kinds = [e["name"][0] for e in ops]
        assert kinds.count("U") == 2 * (2 if name == "leader" else 1)
        assert (tmp_path / f"gantt_{name}.png").stat().st_size > 1000
        assert leader.trace is None and follower.trace is None


# -- configuration and `tandem party` ------------------------------------------------------------
def test_party_config_reads_and_checks_the_reporting_keys(tmp_path):
    from party_helpers import Job
    from tandem.parties.split.process.party_config import PartyConfigError, load_party_config

    job = Job(tmp_path)
    job.cfg["leader"]["train"].update(monitor="auc", patience=3, min_delta=0.01)
    job.write()
    report = load_party_config(job.path("leader")).report_config()
    assert (report.monitor, report.mode, report.patience, report.min_delta) == (
        "val_auc",
        "max",
        3,
        0.01,
    )
    assert report.history == str(tmp_path / "ckpt" / "leader" / "history.jsonl")  # default
    assert report.tensorboard is None and report.keeps_best

    job.cfg["leader"]["log"] = {"history": "logs/h.jsonl", "tensorboard": "tb"}
    job.write()
    report = load_party_config(job.path("leader")).report_config()
    assert (report.history, report.tensorboard) == (
        str(tmp_path / "logs" / "h.jsonl"),
        str(tmp_path / "tb"),
    )

    job.cfg["leader"]["train"]["monitor"] = "macro_f1"
    job.write()
    with pytest.raises(PartyConfigError, match=r"\[train\] monitor 'macro_f1' .* val_ks"):
        load_party_config(job.path("leader"))
    job.cfg["leader"]["train"]["monitor"] = "loss"
    job.cfg["leader"]["train"]["patience"] = 0
    job.write()
    with pytest.raises(PartyConfigError, match=r"\[train\] patience must be >= 1"):
        load_party_config(job.path("leader"))
    job.cfg["follower"]["log"] = {"history": "h.jsonl"}
    job.write()
    with pytest.raises(PartyConfigError, match=r"\[log\] is the leader's"):
        load_party_config(job.path("follower"))


@pytest.mark.slow
def test_party_reports_history_tensorboard_traces_and_best_epoch(tmp_path):
    """`tandem party` as two processes: the leader validates every epoch on the test rows
    (the data have no validation split), writes the history into its checkpoint folder and
    TensorBoard files, and reports the last and best validation metrics; both parties write
    their traces with ``--trace``."""
    from party_helpers import Job

    job = Job(tmp_path, epochs=3)
    job.cfg["leader"]["train"].update(monitor="auc", patience=5)
    job.cfg["leader"]["log"] = {"tensorboard": "tb"}
    for role in ("leader", "follower"):
        job.args[role] = ["--trace", str(tmp_path / "trace"), "--trace-batches", "3"]
    results = job.run_both()
    (rc_l, lead, err_l), (rc_f, fol, err_f) = results["leader"], results["follower"]
    assert rc_l == rc_f == 0, err_l[-2000:] + err_f[-2000:]
    assert lead["status"] == fol["status"] == "done"
    records = _records(tmp_path / "ckpt" / "leader" / "history.jsonl")
    assert [r["epoch"] for r in records] == [0, 1, 2]
    assert lead["history"] == str(tmp_path / "ckpt" / "leader" / "history.jsonl")
    assert lead["validation"]["dataset"] == "test" and lead["validation"]["epoch"] == 2
    assert lead["validation"]["auc"] == pytest.approx(records[-1]["val_auc"])
    best = max(range(3), key=lambda e: (records[e]["val_auc"], -e))
    assert lead["best"]["epoch"] == best and lead["best"]["monitor"] == "val_auc"
    assert lead["early_stopping"]["stopped"] is False and lead["epochs_done"] == 3
    # the export, and so the final test metrics, hold the best epoch's parameters
    assert lead["test_auc"] == pytest.approx(records[best]["val_auc"], abs=1e-9)
    assert {"test_f1", "test_ks", "test_log_loss"} <= lead.keys()
    assert sorted(read_scalars(tmp_path / "tb")["val/auc"]) == [0, 1, 2]
    # checkpoints count training batches only, validation batches in between or not
    assert job.checkpoints("leader") == job.checkpoints("follower") == [10, 12]
    for role, out in (("leader", lead), ("follower", fol)):
        assert out["trace"]["batches"] == 3
        assert (tmp_path / "trace" / f"trace_{role}.json").is_file()
        assert (tmp_path / "trace" / f"gantt_{role}.png").is_file()


def test_a_history_line_cut_short_or_not_utf8_is_skipped_on_resume(tmp_path):
    """A crash may leave a torn last line, a disk bytes that are not UTF-8: a resume keeps the
    records it can read, rewrites the file with them, and finds which epochs it recorded."""
    from tandem.parties.split.reporting import _trim_history

    path = tmp_path / "history.jsonl"
    path.write_bytes(b'{"epoch": 0, "train_loss": 1.0}\n\xff\xfe garbage\n{"epoch": 1, "tr')
    assert _trim_history(str(path), 2) == [{"epoch": 0, "train_loss": 1.0}]
    assert path.read_text(encoding="utf-8").splitlines() == ['{"epoch": 0, "train_loss": 1.0}']
