"""Secure aggregation (tandem.parties.fl.secagg): Shamir sharing, the ring and its masks, the
four-stage protocol over the memory transport with drop-outs and cheats, its composition with
rand-k and the count sketch in whole federations, and the refusals."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from scipy import stats

from fl_helpers import small_setup
from tandem.errors import ConfigError
from tandem.parties.fl.aggregate import ServerRule
from tandem.parties.fl.aggregator import Aggregator, coordinate_median, trimmed_mean
from tandem.parties.fl.federation import run_memory_federation
from tandem.parties.fl.secagg import SecAggConfig, masking, shamir
from tandem.parties.fl.secagg.client import LeaveRound, RoundAbandoned, _check_keys, contribute
from tandem.parties.fl.secagg.graph import Graph, harary_parameters
from tandem.parties.fl.secagg.server import Aborted, SecureRound
from tandem.parties.fl.server import FLConfig, FLServer
from tandem.transports.memory import MemoryNetwork

FAST = SecAggConfig(stage_timeout=1.0)


# -- Shamir ------------------------------------------------------------------------------------
def test_any_t_shares_rebuild_the_secret_and_a_wrong_share_does_not():
    secret = bytes(range(32))
    shares = shamir.split(secret, list(range(1, 11)), 7)
    rng = np.random.default_rng(0)
    for _ in range(5):
        pick = sorted(rng.choice(np.arange(1, 11), 7, replace=False).tolist())
        assert shamir.combine({x: shares[x] for x in pick}, 32, 7) == secret
    bad = dict(shares)
    bad[1] = bytes(16) + bad[1][16:]
    with pytest.raises(shamir.ShareError):  # a chunk falls out of range, or ...
        assert shamir.combine(bad, 32, 7) != secret  # ... the secret comes out wrong
        raise shamir.ShareError("wrong secret")
    with pytest.raises(shamir.ShareError, match="cannot rebuild"):
        shamir.combine({1: shares[1]}, 32, 7)


def test_the_field_modulus_is_the_smallest_prime_above_2_to_the_256():
    def probably_prime(n: int) -> bool:  # Miller-Rabin, 40 random bases
        d, r = n - 1, 0
        while d % 2 == 0:
            d, r = d // 2, r + 1
        for a in np.random.default_rng(0).integers(2, 2**62, 40).tolist():
            x = pow(a, d, n)
            if x in (1, n - 1):
                continue
            for _ in range(r - 1):
                x = pow(x, 2, n)
                if x == n - 1:
                    break
            else:
                return False
        return True

    assert shamir.PRIME == 2**256 + 297 and probably_prime(shamir.PRIME)
    assert not any(probably_prime(2**256 + k) for k in range(1, 297, 2))


# -- the ring and its masks --------------------------------------------------------------------
def test_one_masked_update_is_indistinguishable_from_uniform_noise():
    x = np.linspace(-0.01, 0.01, 200_000, dtype=np.float32)  # a very structured update
    words = masking.encode(x, 1.0, 2.0**20)
    masked = masking.mask(words, bytes(32), {"b": bytes(range(32))}, "a", b"server|0")
    u = masked.astype(np.float64) / 2.0**32
    assert stats.kstest(u, "uniform").pvalue > 0.01
    counts = np.bincount(masked >> 24, minlength=256)
    assert stats.chisquare(counts).pvalue > 0.01
    # the same tests tell the unmasked encoding apart at once
    assert stats.kstest(words.astype(np.float64) / 2.0**32, "uniform").pvalue < 1e-9


def test_the_ring_refuses_a_sum_that_could_overflow_and_names_the_keys():
    masking.check_overflow(100, 1.0, 2.0**20)
    with pytest.raises(ConfigError, match=r"secagg\.scale.*secagg\.clip"):
        masking.check_overflow(100, 10.0, 2.0**22)
    with pytest.raises(ConfigError, match="max_dropout"):
        SecAggConfig(max_dropout=0.5)


# -- the protocol, clients as coroutines -------------------------------------------------------
class Tamper:
    """A client's transport whose outgoing messages of one kind go through ``edit``."""

    def __init__(self, inner, kind: str, edit) -> None:
        self.inner, self.kind, self.edit = inner, kind, edit
        self.name = inner.name

    async def send(self, peer, channel, frame):
        if frame.meta.get("kind") == self.kind:
            frame = self.edit(frame)
        await self.inner.send(peer, channel, frame)

    async def recv(self, peer, channel):
        return await self.inner.recv(peer, channel)


async def secure_sum(payloads, cfg=FAST, *, drop=None, wrap=None, signers=None, roster=None):
    """Run one secure round among ``payloads``' clients; returns ``(round, survivors, sum)``."""
    drop, wrap, signers = drop or {}, wrap or {}, signers or {}
    net = MemoryNetwork()
    server_t = net.endpoint("server")
    names = sorted(payloads)
    shape = payloads[names[0]].shape
    sr = SecureRound(server_t, cfg, 0, names, shape, wait=10.0, roster=roster)
    params = sr.params()

    async def client(c):
        async def hook(rnd, stage):
            if drop.get(c) == stage:
                raise LeaveRound(f"{c} leaves before {stage}")

        t = net.endpoint(c)
        t = wrap[c](t) if c in wrap else t
        try:
            await contribute(
                t, "server", 0, payloads[c], params, hook=hook, signer=signers.get(c), roster=roster
            )
        except (LeaveRound, RoundAbandoned):
            pass

    async with asyncio.TaskGroup() as tg:
        for c in names:
            tg.create_task(client(c))
        try:
            survivors, total = await sr.run()
        except Aborted as exc:
            return sr, None, exc
    return sr, survivors, total


def payloads_of(n: int, shape=(500,), seed=0):
    rng = np.random.default_rng(seed)
    return {f"c{i:02d}": rng.normal(0, 0.05, shape).astype(np.float32) for i in range(n)}


@pytest.mark.parametrize("neighbours, degree", [("auto", 8), ("all", 9)])
async def test_the_sum_equals_the_unmasked_sum_within_fixed_point_error(neighbours, degree):
    p = payloads_of(10)
    sr, survivors, total = await secure_sum(
        p, SecAggConfig(stage_timeout=1.0, neighbours=neighbours)
    )
    assert survivors == sorted(p) and sr.stages == dict.fromkeys(
        ("advertise", "shares", "masked", "unmask"), 10
    )
    assert sr.degree == degree
    want = np.sum([p[c] for c in survivors], axis=0)
    assert np.abs(total - want).max() <= 10 / (2 * FAST.scale) + 1e-6
    assert not sr.cheats


@pytest.mark.parametrize("share", [0.1, 0.3])
@pytest.mark.parametrize("stage", ["masked", "unmask"])
async def test_rounds_complete_with_clients_dropped_after_masking(share, stage):
    """``masked``: they built their masked input but never sent it (their pairwise masks are
    rebuilt from shares); ``unmask``: they sent it and left before unmasking."""
    p = payloads_of(20, seed=1)
    gone = sorted(p)[3 : 3 + round(share * 20)]
    sr, survivors, total = await secure_sum(p, drop=dict.fromkeys(gone, stage))
    kept = [c for c in sorted(p) if c not in gone] if stage == "masked" else sorted(p)
    assert survivors == kept
    want = np.sum([p[c] for c in kept], axis=0)
    assert np.abs(total - want).max() <= 20 / (2 * FAST.scale) + 1e-6
    assert sr.stages["unmask"] == 20 - len(gone)


async def test_too_many_drop_outs_abort_the_round():
    p = payloads_of(10)
    gone = dict.fromkeys(sorted(p)[:4], "masked")  # t = 7 of 10
    sr, survivors, exc = await secure_sum(p, drop=gone)
    assert survivors is None and "below the threshold 7" in str(exc)


async def test_a_client_lying_about_shares_is_named_and_cannot_change_the_sum():
    p = payloads_of(10)

    def lie(frame):
        rows = frame.arrays[0].copy()
        rows[:, :] ^= 0x5A  # every share it returns is wrong
        return frame.replace(arrays=(rows, frame.arrays[1]))

    wrap = {"c04": lambda t: Tamper(t, "unmask", lie)}
    sr, survivors, total = await secure_sum(p, wrap=wrap)
    assert set(sr.cheats) == {"c04"} and "not dealt" in sr.cheats["c04"]
    want = np.sum([p[c] for c in survivors], axis=0)
    assert np.abs(total - want).max() <= 10 / (2 * FAST.scale) + 1e-6


async def test_a_dealer_whose_shares_do_not_match_its_seed_is_named_and_the_round_aborts():
    p = payloads_of(8)

    def other_seed(frame):  # publishes the hash of another seed than the one it shared
        return frame.replace(meta={**frame.meta, "b_hash": "00" * 32})

    sr, survivors, exc = await secure_sum(
        p, wrap={"c03": lambda t: Tamper(t, "shares", other_seed)}
    )
    assert survivors is None and "c03 dealt inconsistent shares" in str(exc)
    assert "self-mask seed" in sr.cheats["c03"]


async def test_the_distributed_noise_hook_adds_noise_of_the_configured_deviation_to_the_sum():
    p = {c: np.zeros(20_000, np.float32) for c in payloads_of(8)}
    sr, survivors, total = await secure_sum(p, SecAggConfig(stage_timeout=1.0, noise_std=0.1))
    assert survivors == sorted(p)
    assert abs(float(np.std(total)) - 0.1) < 0.005 and abs(float(np.mean(total))) < 0.005


async def test_shares_sealed_for_another_client_do_not_open_and_the_round_aborts():
    p = payloads_of(8)

    def scramble(frame):
        rows = frame.arrays[0].copy()
        rows[:, 20] ^= 1
        return frame.replace(arrays=(rows, frame.arrays[1]))

    sr, survivors, exc = await secure_sum(p, wrap={"c01": lambda t: Tamper(t, "shares", scramble)})
    assert survivors is None and isinstance(exc, Aborted)


# -- SecAgg+'s sparse graph --------------------------------------------------------------------
def test_the_sparse_graph_is_regular_symmetric_and_fixed_by_the_key_list():
    names = [f"c{i:03d}" for i in range(100)]
    g = Graph(names, 52, b"seed")
    for u in names:
        near = g.neighbours(u)
        assert len(set(near)) == 52 and u not in near and all(u in g.neighbours(v) for v in near)
        assert g.holders(u) == near
    assert Graph(names, 52, b"seed").neighbours("c000") == g.neighbours("c000")
    assert Graph(names, 52, b"other").neighbours("c000") != g.neighbours("c000")
    full = Graph(names, 99, b"seed")
    assert full.complete and full.holders("c000") == names and len(full.neighbours("c000")) == 99


def test_the_degree_and_threshold_follow_the_threat_model():
    k, t = harary_parameters(100, 0.1, 0.2)
    assert k < 99 and k // 2 < t <= k
    assert harary_parameters(100, 0.2, 0.2)[0] > k  # more colluders: more neighbours
    assert harary_parameters(100, 0.1, 0.3)[0] > k  # more drop-outs: more neighbours
    assert harary_parameters(1000, 0.1, 0.2)[0] / 1000 < k / 100  # a smaller share at scale
    assert harary_parameters(10, 0.2, 0.3) is None  # too few clients for a sparse graph
    assert SecAggConfig(max_dropout=0.2).layout(100) == (k, t)
    assert SecAggConfig(neighbours="all").layout(100) == (99, SecAggConfig().threshold(100))
    assert SecAggConfig(neighbours=200).layout(100) == (99, SecAggConfig().threshold(100))
    with pytest.raises(ConfigError, match="neighbours = 4 is too few.*keeps the guarantees is 52"):
        SecAggConfig(neighbours=4, max_dropout=0.2).layout(100)
    for bad in (5, 0, "some", True):
        with pytest.raises(ConfigError, match="even degree"):
            SecAggConfig(neighbours=bad)
    with pytest.raises(ConfigError, match="corrupt_share"):
        SecAggConfig(corrupt_share=0.5)


def test_the_chosen_graph_keeps_its_guarantees_against_random_colluders_and_drop_outs():
    """Monte Carlo over 300 graphs, each with 10% colluders and 20% drop-outs drawn at random:
    the honest survivors stay connected, every client keeps ``t`` surviving neighbours, and
    no client has ``2t - k`` colluding neighbours (a lying server's bound)."""
    n, rng = 100, np.random.default_rng(7)
    k, t = harary_parameters(n, 0.1, 0.2)
    names = [f"c{i:03d}" for i in range(n)]
    for trial in range(300):
        g = Graph(names, k, rng.bytes(32))
        order = rng.permutation(n)
        corrupt = {names[i] for i in order[:10]}
        dropped = {names[i] for i in order[10:30]}
        honest = [u for u in names if u not in corrupt | dropped]
        seen, todo = {honest[0]}, [honest[0]]
        while todo:
            for v in g.neighbours(todo.pop()):
                if v in honest and v not in seen:
                    seen.add(v)
                    todo.append(v)
        assert len(seen) == len(honest), trial
        for u in names:
            near = set(g.neighbours(u))
            assert len(near - dropped) >= t and len(near & corrupt) < 2 * t - k, (trial, u)


def test_a_client_refuses_a_key_list_with_a_bad_degree_or_threshold():
    names = [f"c{i:02d}" for i in range(10)]
    meta = {"names": names, "t": 5, "k": 6}
    meta.update({key: ["00" * 32] * 10 for key in ("c_pk", "s_pk")})
    meta.update({key: [""] * 10 for key in ("key_id", "sig")})
    t, graph = _check_keys(meta, "c00", b"server|0", None)
    assert t == 5 and len(graph.neighbours("c00")) == 6
    for k, thr, why in ((5, 4, "degree"), (10, 6, "degree"), (6, 3, "threshold"), (9, 5, "thr")):
        with pytest.raises(RoundAbandoned, match=why):
            _check_keys({**meta, "k": k, "t": thr}, "c00", b"server|0", None)


async def test_a_sparse_round_shares_with_neighbours_only_and_survives_drop_outs():
    p = payloads_of(40, seed=2)
    cfg = SecAggConfig(stage_timeout=3.0, max_dropout=0.2)
    k, t = cfg.layout(40)
    assert k < 39
    dealt: dict[str, int] = {}

    def counting(c):
        def edit(frame):
            dealt[c] = frame.arrays[0].shape[0]
            return frame

        return lambda tr: Tamper(tr, "shares", edit)

    gone = sorted(p)[5:9]  # 10% build their masked input and leave
    sr, survivors, total = await secure_sum(
        p, cfg, drop=dict.fromkeys(gone, "masked"), wrap={c: counting(c) for c in p}
    )
    assert sr.degree == k and sr.t_share == t and set(dealt.values()) == {k}
    assert survivors == [c for c in sorted(p) if c not in gone]
    want = np.sum([p[c] for c in survivors], axis=0)
    assert np.abs(total - want).max() <= 40 / (2 * cfg.scale) + 1e-6
    assert not sr.cheats


async def test_signed_keys_are_checked_and_a_substituted_key_is_refused(tmp_path):
    from tandem.transports.keys import Roster, SigningKey, generate

    names = [f"c{i:02d}" for i in range(5)]
    files = {n: generate(n, tmp_path) for n in names}
    signers = {n: SigningKey.from_file(files[n][0]) for n in names}
    roster = Roster.from_files({n: [files[n][1]] for n in names})
    p = payloads_of(5)
    sr, survivors, total = await secure_sum(p, signers=signers, roster=roster)
    assert survivors == names and not sr.cheats

    def forge(frame):  # a key nobody signed (what a key-substituting server would send)
        return frame.replace(meta={**frame.meta, "c_pk": bytes(range(32)).hex()})

    wrap = {"c02": lambda t: Tamper(t, "advertise", forge)}
    sr, survivors, total = await secure_sum(p, signers=signers, roster=roster, wrap=wrap)
    assert "c02" in sr.cheats and survivors == [n for n in names if n != "c02"]


# -- whole federations -------------------------------------------------------------------------
def uniform_mean() -> Aggregator:
    """The plain counterpart of the secure sum: every client weighs 1."""

    def aggregate(state, updates, weights):
        return np.mean(np.stack(updates), axis=0).astype(np.float32), state

    return Aggregator(lambda like: (), aggregate, linear=True)


UPLINKS = {
    "dense": {"kind": "dense"},
    "randk": {"kind": "randk", "k": 40},
    "sketch": {"kind": "sketch", "rows": 3, "cols": 200},
}


@pytest.mark.parametrize("uplink", sorted(UPLINKS))
async def test_secure_rounds_match_plain_rounds_with_each_uplink(uplink):
    data, trainer = small_setup()
    base = dict(rounds=2, fraction=1.0, round_timeout=20.0, seed=3, uplink=UPLINKS[uplink])
    base.update(rule=ServerRule(), downlink="version", sketch_median=False)
    plain = await run_memory_federation(data, trainer, FLConfig(**base, aggregator=uniform_mean()))
    sec = SecAggConfig(clip=10.0, stage_timeout=5.0)
    secure = await run_memory_federation(data, trainer, FLConfig(**base, secagg=sec))
    assert [r.accepted for r in secure.reports] == [["c0", "c1", "c2", "c3"]] * 2
    assert all(r.secure["stages"]["unmask"] == 4 for r in secure.reports)
    np.testing.assert_allclose(secure.model, plain.model, atol=1e-4)
    assert secure.reports[-1].up_bytes > 0


def test_non_linear_rules_and_overflowing_rings_are_refused():
    for rule in (coordinate_median(), trimmed_mean(0.1)):
        with pytest.raises(ConfigError, match="needs each client's update; secure aggregation"):
            FLConfig(secagg=SecAggConfig(), aggregator=rule)
    data, trainer = small_setup()
    cfg = FLConfig(fraction=1.0, secagg=SecAggConfig(scale=2.0**28, clip=4.0))
    with pytest.raises(ConfigError, match=r"secagg\.scale"):  # 2 x 4 x 2^28 = 2^31
        FLServer(MemoryNetwork().endpoint("s"), ["a", "b"], trainer, cfg)
    FLServer(MemoryNetwork().endpoint("s"), ["a"], trainer, cfg)  # 1 x 4 x 2^28 fits


# -- processes ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)  # five processes importing JAX on a loaded 2-core machine
async def test_processes_run_secure_rounds_from_toml_and_survive_a_client_killed_after_masking(
    tmp_path,
):
    """``tandem fl server`` and four clients from TOML alone: secure aggregation with signed
    keys, distributed DP at a target epsilon and the compressed uplink; bank_b is killed
    (SIGKILL) once it has sent its masked input in the last round, and that round completes
    with the others. Every round line carries epsilon (and the one against the server) and the
    time, the summary the final epsilon and epsilon_vs_server, and a client that asks gets the
    final model (``client.final_model``)."""
    import signal

    from safetensors.numpy import load_file

    from fl_process_helpers import CLIENTS, Federation
    from party_helpers import wait_until
    from tandem.parties.fl.dp import epsilon, unamplified_epsilon
    from tandem.transports.keys import generate

    fed = Federation(tmp_path, rounds=2)
    keys = {c: generate(c, tmp_path) for c in CLIENTS}
    roster = {c: str(keys[c][1]) for c in CLIENTS}
    fed.server["server"]["round_timeout"] = 30.0
    fed.server["secagg"] = {"max_dropout": 0.3, "clip": 1.0, "stage_timeout": 5.0}
    fed.server["secagg"]["public_keys"] = roster
    fed.server["dp"] = {"mode": "distributed", "clip": 0.5, "target_epsilon": 8.0, "delta": 1e-3}
    fed.server["compression"] = {"preset": "compressed", "uplink_ratio": 10}
    for c in CLIENTS:
        fed.clients[c]["secagg"] = {"private_key": str(keys[c][0]), "public_keys": roster}
    fed.clients["bank_a"]["client"]["final_model"] = "out/bank_a_final.safetensors"
    fed.write()
    server = fed.start("server", "", "-v")
    clients = {c: fed.start(c, "", "-v") for c in CLIENTS}
    victim = clients["bank_b"]
    try:
        wait_until(
            lambda: "round 1: masked input sent" in victim.err.read_text(), 120, "bank_b masks"
        )
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait(10)
        rc, summary, err = server.finish(120)
        results = {c: clients[c].finish(30) for c in CLIENTS if c != "bank_b"}
    finally:
        for p in (server, *clients.values()):
            if p.popen.poll() is None:
                p.popen.kill()
    assert rc == 0 and summary is not None, err[-3000:]
    assert summary["rounds"] == 2 and summary["version"] == 2, summary
    assert err.count("secure sum: 4/4 clients at stage masked") >= 1, err[-3000:]
    assert "aborted" not in err, err[-3000:]
    for c, (crc, cres, cerr) in results.items():
        assert crc == 0 and cres is not None and cres["rounds_trained"] == 2, f"{c}: {cerr[-2000:]}"
    assert summary["dp"]["mode"] == "distributed", summary
    z = summary["dp"]["noise_multiplier"]
    want = epsilon(z, rounds=2, sampled=4, clients=4, delta=1e-3)
    assert summary["dp"]["epsilon"] == pytest.approx(want, abs=1e-3) and want <= 8.0
    # against the server, which knows who took part: bank_a was in both rounds, unamplified
    # (all 4 of 4 were sampled, so nothing was amplified and the figures agree)
    vs_server = unamplified_epsilon(z, rounds=2, delta=1e-3)
    assert summary["dp"]["epsilon_vs_server"] == pytest.approx(vs_server, abs=1e-3), summary
    assert summary["dp"]["epsilon_vs_server"] >= summary["dp"]["epsilon"] - 1e-3
    lines = [line for line in err.splitlines() if line.startswith("round ")]
    assert len(lines) == 2 and all("epsilon" in x and "elapsed" in x for x in lines), lines
    assert all("(vs server " in x for x in lines), lines
    assert "unknown_peer" not in err, err[-3000:]  # a normal join logs no refusal
    final = results["bank_a"][1]["final_model"]
    assert final is not None and results["bank_c"][1]["final_model"] is None
    assert load_file(final)["params"].shape == (summary["params"],)


def test_the_secagg_tables_of_the_toml_files_are_checked_and_built(tmp_path):
    from fl_process_helpers import Federation
    from tandem.parties.fl.config import FLConfigError, load_client_config, load_server_config
    from tandem.parties.fl.server_process import build_fl_config

    fed = Federation(tmp_path, rounds=1)
    fed.server["secagg"] = {"max_dropout": 0.2, "clip": 0.5, "noise_std": 0.01}
    fed.write()
    cfg = load_server_config(fed.path("server"))
    built = build_fl_config(cfg, 100)
    assert built.secagg == SecAggConfig(max_dropout=0.2, clip=0.5, noise_std=0.01)
    fed.server["secagg"] = {"neighbours": "all", "corrupt_share": 0.2}
    fed.write()
    built = build_fl_config(load_server_config(fed.path("server")), 100)
    assert built.secagg == SecAggConfig(neighbours="all", corrupt_share=0.2)
    assert cfg.secagg is not None and cfg.secagg.roster() is None
    assert "secagg" in cfg.identity()
    fed.server["secagg"] = {"max_dropout": 0.6}
    fed.clients["bank_a"]["secagg"] = {"private_key": "bank_a.key"}
    fed.write()
    with pytest.raises(FLConfigError, match="max_dropout"):
        load_server_config(fed.path("server"))
    with pytest.raises(FLConfigError, match="private_key and secagg.public_keys go together"):
        load_client_config(fed.path("bank_a"))
