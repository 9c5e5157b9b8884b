"""``tandem elastic`` sub-commands: the one-process demo with churn, data preparation, and
configuration errors that name the key and the fix."""

from __future__ import annotations

import json

from tandem.parties.cli import main
from tandem.parties.elastic.spec import load_shard, load_spec


def test_demo_with_churn_commits_every_batch_once(capsys, tmp_path):
    rc = main(
        [
            "elastic",
            "demo",
            "--quiet",
            "--epochs",
            "3",
            "--rows",
            "256",
            "--workers",
            "3",
            "--interval",
            "0.05",
            "--churn",
            "--plot",
            str(tmp_path / "loss.png"),
        ]
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert result["exactly_once"] and result["epochs"] == 3
    assert result["final_loss"] < 0.25 * result["initial_loss"]
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_prepare_writes_loadable_model_and_shards(tmp_path, capsys):
    assert (
        main(["elastic", "prepare", "--out", str(tmp_path), "--shards", "2", "--rows", "64"]) == 0
    )
    spec = load_spec(str(tmp_path / "model.json"))
    assert load_shard(str(tmp_path / "shard1.npz"), spec).x.shape == (64, spec.sizes[0])


def test_role_config_errors_are_clear(tmp_path, capsys):
    assert main(["elastic", "worker", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "nothing found" in capsys.readouterr().err
    bad = tmp_path / "w.toml"
    bad.write_text('name = "w0"\ncoordinator = "http://127.0.0.1:1"\nheartbeat = "fast"\n')
    assert main(["elastic", "worker", "--config", str(bad)]) == 2
    assert "'heartbeat' must be float" in capsys.readouterr().err
    bad.write_text('name = "c"\n[data_servers]\nds0 = "http://127.0.0.1:1"\nintervall = 1\n')
    bad.write_text('name = "c"\nintervall = 1\n[data_servers]\nds0 = "http://127.0.0.1:1"\n')
    assert main(["elastic", "coordinator", "--config", str(bad)]) == 2
    assert "unknown key(s) ['intervall']" in capsys.readouterr().err


def test_a_worker_no_coordinator_welcomes_exits_with_a_clear_error(tmp_path, capsys):
    """Started after its coordinator finished (or at a wrong address), a worker used to beat
    into the void forever; it now gives up after ``join_timeout`` and says why."""
    cfg = tmp_path / "w.toml"
    cfg.write_text(
        'name = "w9"\ncoordinator = "http://127.0.0.1:1"\nheartbeat = 0.05\njoin_timeout = 0.5\n'
    )
    assert main(["elastic", "worker", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "no WELCOME from coordinator 'coordinator' within 0.5 s" in err
    assert "raise join_timeout" in err
    cfg.write_text('name = "w9"\ncoordinator = "http://127.0.0.1:1"\njoin_timeout = 0\n')
    assert main(["elastic", "worker", "--config", str(cfg)]) == 2
    assert "join_timeout must be > 0 s" in capsys.readouterr().err
