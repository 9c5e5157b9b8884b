"""A federation as processes over HTTP: ``tandem fl server`` and four ``tandem fl client``.

A sixth process, a client holding the secret but missing from the server's roster, is refused
and exits 2 saying so. One client is killed (SIGKILL) while the server waits on its round, and
started again; later the server is killed (SIGKILL) and started again, resuming from its
checkpoint while the clients reconnect. Training must complete every round, export the global
model, and end within 1 point of test accuracy of the same configuration run in one process
over the memory transport (`tandem.parties.fl.local.run_local`). The server aggregates with a
robust rule from its TOML (a trimmed mean). Every round waits for all
four clients (``min_clients = 4``, long round deadline) and everything is seeded, so the two
runs see the same updates in the same rounds: the comparison does not depend on when the
kills land.
"""

from __future__ import annotations

import signal

import pytest

from fl_process_helpers import CLIENTS, Federation
from party_helpers import wait_until
from tandem.parties.export.model import load_model_sync
from tandem.parties.fl.config import load_client_config, load_server_config
from tandem.parties.fl.local import run_local

ROUNDS = 12


def rounds_done(proc) -> int:
    return proc.err.read_text().count("clients, up ")


@pytest.mark.slow
@pytest.mark.timeout(300)  # six processes importing JAX on a loaded 2-core machine
async def test_kill_a_client_and_the_server_training_completes_as_in_one_process(tmp_path):
    fed = Federation(tmp_path, rounds=ROUNDS)
    fed.server["aggregation"] = {"rule": "trimmed_mean", "trim": 0.25}
    fed.clients["mallory"] = {  # holds the secret but is not in the server's roster
        **fed.clients["bank_a"],
        "client": {**fed.clients["bank_a"]["client"], "name": "mallory", "port": 0},
    }
    fed.write()
    server = fed.start("server")
    intruder = fed.start("mallory")
    clients = {c: fed.start(c) for c in CLIENTS}
    try:
        wait_until(lambda: rounds_done(server) >= 3, 60, "3 rounds")
        clients["bank_b"].popen.send_signal(signal.SIGKILL)  # mid round 4: the server waits
        clients["bank_b"].popen.wait(10)
        clients["bank_b"] = fed.start("bank_b", ".2")
        wait_until(lambda: rounds_done(server) >= 7, 60, "7 rounds")
        server.popen.send_signal(signal.SIGKILL)
        server.popen.wait(10)
        first_part = rounds_done(server)
        server = fed.start("server", ".2")
        rc, summary, err = server.finish(90)
        assert rc == 0, err[-3000:]
        results = {c: p.finish(30) for c, p in clients.items()}
        refused = intruder.finish(30)
    finally:
        for p in (server, intruder, *clients.values()):
            if p.popen.poll() is None:
                p.popen.kill()
    assert summary is not None, err[-3000:]
    assert summary["rounds"] == ROUNDS and summary["version"] == ROUNDS
    assert summary["aggregation"] == "trimmed_mean", summary
    assert 0 < summary["resumed_at"] <= first_part  # resumed, at most the round it died in
    assert (tmp_path / "out" / "global.safetensors").exists()
    exported = load_model_sync(str(tmp_path / "out" / "global.safetensors"))
    assert exported.data is not None and exported.data["preprocessing"] is not None
    assert refused[0] == 2 and "refused 'mallory'" in refused[2], refused[2][-2000:]
    for c, (crc, cres, cerr) in results.items():
        assert crc == 0 and cres is not None, f"{c}: {cerr[-2000:]}"
        assert cres["reconnects"] >= 1, c  # every client lived through the server's restart

    exported = load_model_sync(tmp_path / "out" / "global.safetensors")
    assert exported.party == "server" and exported.loss == "softmax"

    reference = await run_local(
        load_server_config(fed.path("server")), [load_client_config(fed.path(c)) for c in CLIENTS]
    )
    assert reference["accuracy"] > 80
    assert abs(summary["accuracy"] - reference["accuracy"]) <= 1.0, (summary, reference["accuracy"])
