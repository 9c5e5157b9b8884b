"""Federated preprocessing under secure aggregation (issue 43, point 4): the clients' numeric
summaries go through the secure sum, so the server learns their totals and no client's.

Pure: the limb encoding sums exactly (two's complement, fixed point 2^-32), a value beyond
``preprocessing.max_abs`` is refused naming the key, a bound that could overflow is refused.
End to end over the memory transport (the server's `gather_summaries` and each client's
`connect`): the merged state equals the one merged from the summaries in the clear, the
server never receives a client's sums (its masked words are not its limbs), a string
categorical column is hashed, and one that is not is refused unless the user opts in."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from fl_process_helpers import SECRET, to_toml
from ports import free_port
from tandem.errors import ConfigError
from tandem.parties.data import DataError, read_table
from tandem.parties.data.summary import merge, summarize, summarize_source
from tandem.parties.export.stages import read_description
from tandem.parties.fl import secure_summary as S
from tandem.parties.fl.client_process import Connection, connect, run_client
from tandem.parties.fl.config import load_client_config, load_server_config
from tandem.parties.fl.preprocessing import global_state
from tandem.parties.fl.secagg.messages import SECAGG
from tandem.parties.fl.server_process import run_server
from tandem.parties.fl.summary_exchange import check_summary_config, gather_summaries
from tandem.transports.base import Frame
from tandem.transports.memory import MemoryNetwork

CLIENTS = ["bank_a", "bank_b", "bank_c"]
CITIES = ["lyon", "oslo", "rome", "kyiv"]


def write_party(path: Path, n: int, shift: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lines = ["id,a,b,city,y"]
    for i in range(n):
        a = "" if i % 7 == 0 else f"{rng.normal(shift, 2.0 + shift):.6f}"
        city = CITIES[int(rng.integers(len(CITIES)))]
        lines.append(f"{path.stem}-{i},{a},{rng.normal(-shift, 1.0):.6f},{city},{i % 2}")
    path.write_text("\n".join(lines) + "\n")


def write_configs(
    tmp_path: Path, *, secagg: bool, hashed: bool, reveal: bool = False, port: int = 1
):
    data = {
        "id_column": "id",
        "label_column": "y",
        "categorical": ["city"],
        "missing": "mean",
    } | ({"hash_buckets": {"city": 32}, "hash_seed": 7} if hashed else {})
    for i, c in enumerate(CLIENTS):
        write_party(tmp_path / f"{c}.csv", 60 + 10 * i, (0.0, 5.0, 20.0)[i], i)
    write_party(tmp_path / "server.csv", 40, 2.0, 9)
    server = {
        "server": {
            "port": port,
            "clients": CLIENTS,
            "rounds": 1,
            "loss": "binary",
            "wait": 60.0,
            "round_timeout": 60.0,
            "export": "out/global.safetensors",
        },
        "model": {"kind": "mlp", "hidden": [4], "out_dim": 1},
        "data": {"source": "server.csv", **data},
        "http": {"secret": SECRET},
        "preprocessing": {"reveal_categories": reveal},
    } | ({"secagg": {"max_dropout": 0.0, "stage_timeout": 20.0}} if secagg else {})
    (tmp_path / "server.toml").write_text(to_toml(server))
    for c in CLIENTS:
        table = {
            "client": {
                "name": c,
                "server": f"http://127.0.0.1:{port}",
                "port": free_port() if port != 1 else 1,
                "reconnect_timeout": 60.0,
            },
            "data": {"source": f"{c}.csv", **data, "split": {"test": 0.0}},
            "http": {"secret": SECRET},
        }
        (tmp_path / f"{c}.toml").write_text(to_toml(table))
    scfg = load_server_config(tmp_path / "server.toml")
    return scfg, [load_client_config(tmp_path / f"{c}.toml") for c in CLIENTS]


class Recorder:
    """The server's endpoint, recording every frame it receives from a client."""

    def __init__(self, inner) -> None:
        self.inner, self.frames = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def recv(self, peer, channel):
        frame = await self.inner.recv(peer, channel)
        self.frames.append((peer, channel, frame))
        return frame


async def exchange(scfg, ccfgs):
    """The summary exchange over one memory network; the server welcomes every client once
    it has merged. Returns the server's summaries, the frames it received, the clients'
    own summaries and their welcomes."""
    net = MemoryNetwork()
    server = Recorder(net.endpoint(scfg.name))
    own = {c.name: summarize_source(c.data) for c in ccfgs}
    links = [Connection(net.endpoint(c.name), c, "http://127.0.0.1:1", own[c.name]) for c in ccfgs]

    async def serve():
        summaries, hellos = await gather_summaries(server, scfg)
        state = await asyncio.to_thread(global_state, scfg.data, summaries, 1)
        for c in sorted({h[0] for h in hellos}):
            await server.inner.send(c, "fl/model", Frame(meta={"kind": "welcome"}))
        return summaries, state

    async with asyncio.timeout(120):
        served, *welcomes = await asyncio.gather(serve(), *(connect(link) for link in links))
    return served, server.frames, own, welcomes


def clear_state(scfg, own):
    table = read_table(scfg.data.source)
    return merge({c: S.clear_part(s) for c, s in own.items()}, scfg.data, table)


# -- pure ----------------------------------------------------------------------------------------
def test_limb_sums_decode_to_the_exact_totals_of_signed_fixed_point_values():
    summaries = [
        {"numeric": [{"name": "a", "present": 5, "missing": 1, "sum": -3.25, "sumsq": 1e9}]},
        {"numeric": [{"name": "a", "present": 7, "missing": 0, "sum": 2.0**-20, "sumsq": 0.5}]},
        {"numeric": [{"name": "a", "present": 0, "missing": 4, "sum": -1e6, "sumsq": 3.0}]},
    ]
    words = sum(S.encode(s, 1e12, "x").astype(np.uint64) for s in summaries)
    assert words.max() < 2**32  # no limb sum wraps
    (total,) = S.decode(words.astype(np.uint32), ["a"])
    assert total == {
        "name": "a",
        "present": 12,
        "missing": 5,
        "sum": -3.25 + 2.0**-20 - 1e6,
        "sumsq": 1e9 + 3.5,
    }


def test_values_beyond_the_stated_bound_and_bounds_that_could_overflow_are_refused():
    summary = {"numeric": [{"name": "income", "present": 1, "missing": 0, "sum": 5e6}]}
    summary["numeric"][0] |= {"sumsq": 2.5e13, "peak": 5e6}
    with pytest.raises(DataError, match="'income'.*preprocessing.max_abs = 1e\\+06"):
        S.encode(summary, 1e6, "bank_a.toml")
    S.check_bound(1e12, 1000)
    with pytest.raises(ConfigError, match="preprocessing.max_abs = 1e\\+16 with 1000 clients"):
        S.check_bound(1e16, 1000)


# -- end to end over the memory transport ------------------------------------------------------
@pytest.mark.timeout(180)
def test_the_server_learns_only_the_totals_and_merges_the_state_of_the_clear_exchange(tmp_path):
    scfg, ccfgs = write_configs(tmp_path, secagg=True, hashed=True)
    check_summary_config(scfg)
    (summaries, state), frames, own, welcomes = asyncio.run(exchange(scfg, ccfgs))
    assert all(w["kind"] == "welcome" for w in welcomes)
    expected = clear_state(scfg, own)
    assert state.numeric == expected.numeric == ("a", "b")
    for got, want in (
        (state.fill, expected.fill),
        (state.mean, expected.mean),
        (state.std, expected.std),
    ):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert state.vocabularies[0].buckets == 32 and state.vocabularies[0].seed == 7
    # what reached the server: public parts with no sum, and masked words
    received = [f for _, ch, f in frames if ch == "fl/hello"]
    text = json.dumps([f.meta for f in received])
    assert '"sum"' not in text and '"sumsq"' not in text and '"peak"' not in text
    assert '"values": []' in text  # the hashed column's values stay with each client
    for s in own.values():
        for c in s["numeric"]:
            for q in ("sum", "sumsq"):
                assert repr(c[q]) not in text
    masked = {p: f.arrays[0] for p, ch, f in frames if ch == SECAGG and f.meta["kind"] == "masked"}
    assert sorted(masked) == CLIENTS
    for name, words in masked.items():
        limbs = S.encode(own[name], 1e12, name).astype(np.uint32)
        assert np.mean(words == limbs) < 0.01  # its limbs are mostly small; masked words are not
    # the server's totals give the global means, which are none of the clients' own means
    totals = summaries[S.TOTALS]["numeric"]
    for j, column in enumerate(totals):
        global_mean = column["sum"] / column["present"]
        own_means = [s["numeric"][j]["sum"] / s["numeric"][j]["present"] for s in own.values()]
        assert all(abs(global_mean - m) > 0.5 for m in own_means)
    assert {c: s["numeric"] for c, s in summaries.items() if c != S.TOTALS} == {
        c: [{"name": n, "present": 0, "missing": 0, "sum": 0, "sumsq": 0} for n in ("a", "b")]
        for c in CLIENTS
    }


def test_an_unhashed_categorical_column_under_secure_aggregation_is_refused_unless_opted_in(
    tmp_path,
):
    scfg, _ = write_configs(tmp_path, secagg=True, hashed=False)
    with pytest.raises(ConfigError, match="reveal_categories = true"):
        check_summary_config(scfg)
    scfg, _ = write_configs(tmp_path, secagg=False, hashed=False)
    check_summary_config(scfg)  # no secure aggregation: the summaries go in the clear


@pytest.mark.timeout(180)
def test_opted_in_categories_travel_in_the_clear_beside_the_secure_numeric_sums(tmp_path):
    scfg, ccfgs = write_configs(tmp_path, secagg=True, hashed=False, reveal=True)
    check_summary_config(scfg)
    (summaries, state), frames, own, _ = asyncio.run(exchange(scfg, ccfgs))
    expected = clear_state(scfg, own)
    assert state.vocabularies == expected.vocabularies
    assert state.mean == pytest.approx(expected.mean, rel=1e-9)


@pytest.mark.timeout(180)
def test_without_secure_aggregation_the_exchange_sends_the_summaries_in_the_clear(tmp_path):
    scfg, ccfgs = write_configs(tmp_path, secagg=False, hashed=True)
    (summaries, state), frames, own, _ = asyncio.run(exchange(scfg, ccfgs))
    assert summaries == {c: S.clear_part(s) for c, s in own.items()}
    assert not [f for _, ch, f in frames if ch == SECAGG]
    assert state == clear_state(scfg, own)
    table = read_table(ccfgs[0].data.source)
    assert summarize(table, ccfgs[0].data, np.arange(3))["categorical"][0]["values"] == []


@pytest.mark.slow
@pytest.mark.timeout(300)  # four parties importing and compiling on a loaded 2-core machine
def test_a_secure_federation_over_http_trains_under_the_securely_merged_state_and_exports_it(
    tmp_path,
):
    """``run_server`` and three ``run_client`` over HTTP with ``[secagg]`` and a hashed
    string column: the summaries' secure sum, then secure training rounds; the export holds
    the state the clear merge gives."""
    scfg, ccfgs = write_configs(tmp_path, secagg=True, hashed=True, port=free_port())

    async def federation():
        async with asyncio.timeout(240):
            server = asyncio.create_task(run_server(scfg, fresh=True))
            results = await asyncio.gather(*(run_client(c) for c in ccfgs))
            return await server, results

    summary, results = asyncio.run(federation())
    assert summary["rounds"] == 1 and all(r["rounds_trained"] == 1 for r in results)
    state = read_description(tmp_path / "out" / "global.safetensors")["data"]["preprocessing"]
    expected = clear_state(scfg, {c.name: summarize_source(c.data) for c in ccfgs}).to_json()
    assert state["categorical"] == expected["categorical"]
    assert state["categorical"][0]["buckets"] == 32
    for got, want in zip(state["numeric"], expected["numeric"], strict=True):
        assert got["name"] == want["name"]
        for key in ("fill", "mean", "std"):
            assert got[key] == pytest.approx(want[key], rel=1e-9)
