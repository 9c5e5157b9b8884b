"""Benchmark: private federated learning (secure aggregation; other metrics join as functions).

    python -m bench.fl_private --json           # one JSON line on stdout

Each metric group is a function ``(args) -> dict`` in `METRICS`; ``--only NAME`` runs one.

``secagg`` (tandem.parties.fl.secagg, clients in-process over the memory transport):

* ``secagg_s_per_round_ratio``: seconds of one secure round / one plain round, 100 clients,
  the 1M-parameter MLP 64-1000-936-10, compressed uplink (rand-k, 1/60 of the coordinates),
  10 clients dropping in the round (secure: after building their masked input, before sending
  it, so their mask keys are rebuilt from shares; plain: after training, before replying;
  both close their link, so neither waits for a deadline). Each federation runs a warm-up
  round first (JAX compiles, the full model goes down); the second round is timed. The
  secure round runs SecAgg+ with ``max_dropout = 0.2`` (``--neighbours``: its
  ``secagg.neighbours``); ``secagg_degree`` and ``secagg_share_threshold`` are its graph's.
* ``secagg_uplink_ratio``: dense uplink bytes / secure compressed uplink bytes of that round
  (the server transport's counters, headers and every secure-aggregation message included).
* ``secagg_acc_delta``: plain minus secure accuracy in points after ``--acc-rounds`` rounds of
  digits, 10 clients, Dirichlet 0.5, MLP 64-128-64-10, rand-k uplink; same seeds.

``dp`` (tandem.parties.fl.dp, central DP with adaptive clipping at the median update norm):
digits over ``--dp-clients`` clients (Dirichlet 0.5), ``--dp-fraction`` of them per round,
``--dp-rounds`` rounds, MLP 64-64-10, FedAvg with server momentum 0.5.

* ``acc_nonprivate``: accuracy (%) without DP;
* ``dp_acc``: epsilon -> accuracy (%) at epsilon 8 and 1, delta = 1 / clients (the noise
  multiplier solved by the RDP accountant for those rounds and that sampling rate).

``byzantine`` (tandem.parties.fl.robust): digits over 20 clients (Dirichlet 0.5), every client
each round, ``--byz-rounds`` rounds, MLP 64-64-10; 20% of the clients (4) attack by sending
their update times 1000 ("scale") or times -1 ("sign"):

* ``clean_acc``: the mean without attackers;
* ``mean_acc_attacked``: attack -> the mean's accuracy under it;
* ``byzantine_acc``: rule -> its worst accuracy over the two attacks
  (``byzantine_acc_by_attack`` has each).

``compressed`` (`bench.fl_compressed`, its keys and knobs with the ``--compressed-`` prefix):
dense against compressed FedAdam on the user-like non-IID tabular task (six clients, 20
numeric and one categorical column, MLP of 1.06M parameters, 20 rounds):

* ``compressed_acc_gap``: dense minus compressed final accuracy in points (target <= 0.5),
  beside ``compressed_early_deficit``, the byte ratios and the per-round curve.

``sketch`` (`bench.fl_sketch`): the count sketch's heavy-hitter recovery at d = 1M,
``--sketch-seeds`` draws:

* ``sketch_recall_1m``: share of the true heavy set in the estimate's top-h (median over the
  draws; target >= 0.95), beside ``sketch_recall_1m_min`` and the sketch's shape
  (``sketch_rows``, ``sketch_cols``, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections.abc import Callable

import orjson

from tandem.parties.fl import presets
from tandem.parties.fl.aggregate import ServerRule
from tandem.parties.fl.client import FLClient, compress_update
from tandem.parties.fl.data import FederatedData, load_federated_digits
from tandem.parties.fl.dp import DPConfig, noise_for_epsilon
from tandem.parties.fl.federation import make_trainer, run_memory_federation
from tandem.parties.fl.robust import build_rule
from tandem.parties.fl.secagg import SecAggConfig
from tandem.parties.fl.secagg.client import LeaveRound

from . import fl_compressed, fl_sketch

HIDDEN_1M = [1000, 936]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def dropping_client(gone: set[str], last: int) -> Callable[..., FLClient]:
    """An `FLClient` class whose clients named in ``gone`` leave round ``last``: after
    training (plain) or after masking (secure), closing their link."""

    class Dropping(FLClient):
        secure = False

        async def before_reply(self, rnd: int) -> None:
            if self.transport.name in gone and rnd == last and not self.secure:
                await self.transport.aclose()

        async def secagg_stage(self, rnd: int, stage: str) -> None:
            if self.transport.name in gone and rnd == last and stage == "masked":
                await self.transport.aclose()
                raise LeaveRound(f"{self.transport.name} leaves after masking")

        async def handle(self, frame) -> None:
            self.secure = bool(frame.meta.get("secagg"))
            await super().handle(frame)

    return Dropping


def timed_round(data: FederatedData, trainer, cfg, gone: set[str]) -> tuple[float, int, dict]:
    """Seconds, uplink bytes and the secure-aggregation report (empty without) of the last
    round of ``cfg`` (the first warms up: it compiles the server's kernels and sends the full
    model)."""
    cls = dropping_client(gone, cfg.rounds - 1)
    server = asyncio.run(run_memory_federation(data, trainer, cfg, client_cls=cls))
    rep = server.reports[-1]
    want = len(data.clients) - len(gone)
    if len(rep.accepted) != want:
        raise RuntimeError(f"round kept {len(rep.accepted)} clients, expected {want}: {rep}")
    return rep.seconds, rep.up_bytes, rep.secure or {}


def secagg(args: argparse.Namespace) -> dict:
    n = args.clients
    data = load_federated_digits(n, 0.5, args.seed)
    trainer = make_trainer(data, HIDDEN_1M, lr=0.01, epochs=1, batch_size=32, init_seed=args.seed)
    x, y = data.clients[0]
    trainer.train(trainer.init_vec, x, y, 0)  # compile before timing
    common = dict(rounds=2, fraction=1.0, seed=args.seed, eval_every=0, round_timeout=600.0)
    plain = presets.compressed(trainer.dim, **common)
    compress_update(trainer.init_vec, plain.uplink, 1)
    secure = presets.compressed(
        trainer.dim,
        secagg=SecAggConfig(max_dropout=0.2, stage_timeout=600.0, neighbours=args.neighbours),
        **common,
    )
    gone = {f"c{i}" for i in range(0, n, 10)}  # 10%
    t_plain, _, _ = timed_round(data, trainer, plain, gone)
    log(f"plain compressed round: {t_plain:.2f} s ({n} clients, {len(gone)} dropped)")
    t_secure, up_secure, report = timed_round(data, trainer, secure, gone)
    log(f"secure compressed round: {t_secure:.2f} s, up {up_secure} B")
    _, up_dense, _ = timed_round(data, trainer, presets.dense(**common), set())
    per_dense = up_dense / n
    per_secure = up_secure / (n - len(gone))  # bytes of a client that finished the round
    log(f"dense round: up {up_dense} B")
    acc_plain, acc_secure = accuracy_pair(args)
    return {
        "secagg_clients": n,
        "secagg_params": trainer.dim,
        "secagg_dropped": len(gone),
        "secagg_degree": report.get("degree"),
        "secagg_share_threshold": report.get("share_threshold"),
        "secagg_s_plain": round(t_plain, 3),
        "secagg_s_secure": round(t_secure, 3),
        "secagg_s_per_round_ratio": round(t_secure / t_plain, 3),
        "secagg_uplink_ratio": round(per_dense / per_secure, 2),
        "secagg_acc_plain": acc_plain,
        "secagg_acc_secure": acc_secure,
        "secagg_acc_delta": round(acc_plain - acc_secure, 2),
    }


def accuracy_pair(args: argparse.Namespace) -> tuple[float, float]:
    """Final test accuracy (%) of a plain and a secure run of the small task."""
    data = load_federated_digits(10, 0.5, args.seed)
    trainer = make_trainer(data, [128, 64], lr=0.05, epochs=2, init_seed=args.seed)
    common = dict(rounds=args.acc_rounds, fraction=1.0, seed=args.seed, eval_every=0)
    out = []
    for sec in (None, SecAggConfig(stage_timeout=60.0)):
        cfg = presets.compressed(trainer.dim, uplink_ratio=10, secagg=sec, **common)
        server = asyncio.run(run_memory_federation(data, trainer, cfg))
        if (sec is None) != (server.reports[-1].secure is None):
            raise RuntimeError("the secure run did not aggregate securely (or the plain did)")
        out.append(round(100 * server.reports[-1].accuracy, 2))
        log(f"{'secure' if sec else 'plain'} small task: {out[-1]}%")
    return out[0], out[1]


def dp(args: argparse.Namespace) -> dict:
    n, rounds = args.dp_clients, args.dp_rounds
    data = load_federated_digits(n, 0.5, args.seed)
    trainer = make_trainer(data, [64], lr=0.1, epochs=2, init_seed=args.seed)
    per_round = max(1, round(args.dp_fraction * n))
    base = presets.dense(
        rounds=rounds,
        fraction=per_round / n,
        seed=args.seed,
        eval_every=0,
        round_timeout=600.0,
    )
    base = dataclasses.replace(base, rule=ServerRule(momentum=0.5))

    def run(cfg) -> float:
        server = asyncio.run(run_memory_federation(data, trainer, cfg))
        return round(100 * server.reports[-1].accuracy, 2)

    acc_plain = run(base)
    log(f"dp: non-private {acc_plain}%")
    out: dict = {}
    multipliers: dict = {}
    for eps in (8.0, 1.0):
        kw = dict(rounds=rounds, sampled=per_round, clients=n, delta=1.0 / n)
        z = noise_for_epsilon(eps, **kw)
        cfg = DPConfig(
            clip=0.5,
            noise_multiplier=z,
            delta=1.0 / n,
            adaptive=True,
            quantile=0.5,
            count_std=max(per_round / 20, z),
        )
        out[str(int(eps))] = run(dataclasses.replace(base, dp=cfg))
        multipliers[str(int(eps))] = round(z, 4)
        log(f"dp: epsilon {eps} (z {z:.3f}): {out[str(int(eps))]}%")
    return {
        "dp_clients": n,
        "dp_per_round": per_round,
        "dp_rounds": rounds,
        "acc_nonprivate": acc_plain,
        "dp_acc": out,
        "dp_noise_multiplier": multipliers,
    }


def attacking_client(bad: set[str], factor: float) -> Callable[..., FLClient]:
    """An `FLClient` class whose clients in ``bad`` send ``factor`` times their update."""

    class Scaled:
        def __init__(self, inner) -> None:
            self.inner = inner

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

        def train(self, *a):
            return factor * self.inner.train(*a)

    class Attacker(FLClient):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            if self.transport.name in bad:
                self.trainer = Scaled(self.trainer)  # type: ignore[assignment]

    return Attacker


BYZ_RULES = {
    "mean": {},
    "median": {},
    "trimmed_mean": {"trim": 0.2},
    "krum": {"byzantine": 4},
    "multi_krum": {"byzantine": 4},
    "norm_bound": {"norm": 1.0},
}


def byzantine(args: argparse.Namespace) -> dict:
    n = 20
    data = load_federated_digits(n, 0.5, args.seed)
    trainer = make_trainer(data, [64], lr=0.1, epochs=2, init_seed=args.seed)
    base = presets.dense(
        rounds=args.byz_rounds, fraction=1.0, seed=args.seed, eval_every=0, round_timeout=600.0
    )
    bad = {f"c{i}" for i in range(0, n, 5)}  # 20%

    def run(rule: str, factor: float | None) -> float:
        cfg = dataclasses.replace(base, aggregator=build_rule(rule, **BYZ_RULES[rule]))
        cls = FLClient if factor is None else attacking_client(bad, factor)
        server = asyncio.run(run_memory_federation(data, trainer, cfg, client_cls=cls))
        return round(100 * server.reports[-1].accuracy, 2)

    clean = run("mean", None)
    log(f"byzantine: clean mean {clean}%")
    by_attack: dict = {}
    for attack, factor in (("scale", 1000.0), ("sign", -1.0)):
        by_attack[attack] = {}
        for rule in BYZ_RULES:
            by_attack[attack][rule] = run(rule, factor)
            log(f"byzantine: {attack} attack, {rule}: {by_attack[attack][rule]}%")
    worst = {rule: min(by_attack[a][rule] for a in by_attack) for rule in BYZ_RULES}
    return {
        "clean_acc": clean,
        "mean_acc_attacked": {a: by_attack[a]["mean"] for a in by_attack},
        "byzantine_acc": {r: v for r, v in worst.items() if r != "mean"},
        "byzantine_acc_by_attack": by_attack,
        "byzantine_attackers": len(bad),
    }


def sketch(args: argparse.Namespace) -> dict:
    """``sketch_recall_1m`` and its companions (`bench.fl_sketch`), over ``--sketch-seeds``."""
    keys = fl_sketch.recall_keys(args.sketch_seeds)
    return {(k if k.startswith("sketch") else f"sketch_{k}"): v for k, v in keys.items()}


METRICS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "secagg": secagg,
    "dp": dp,
    "byzantine": byzantine,
    "compressed": fl_compressed.compressed_gap,
    "sketch": sketch,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--only", choices=sorted(METRICS), action="append")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument(
        "--neighbours",
        type=lambda v: v if v in ("auto", "all") else int(v),
        default="auto",
        help='secagg.neighbours of the timed secure round: "auto" (SecAgg+), "all" or a degree',
    )
    p.add_argument("--acc-rounds", type=int, default=30)
    p.add_argument("--dp-clients", type=int, default=100)
    p.add_argument("--dp-fraction", type=float, default=0.2)
    p.add_argument("--dp-rounds", type=int, default=30)
    p.add_argument("--byz-rounds", type=int, default=15)
    p.add_argument("--sketch-seeds", type=int, default=3)
    fl_compressed.add_arguments(p, prefix="compressed-")
    args = p.parse_args(argv)
    out: dict = {"bench": "fl_private"}
    for name in args.only or sorted(METRICS):
        t0 = time.perf_counter()
        out.update(METRICS[name](args))
        log(f"{name}: {time.perf_counter() - t0:.1f} s")
    print(orjson.dumps(out).decode() if args.json else out, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
