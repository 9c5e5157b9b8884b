"""Benchmark: what split learning's cut tensors leak, and what each defense costs.

    python -m bench.privacy --json                 # one JSON line on stdout (progress: stderr)
    python -m bench.privacy --quick --json         # small sizes (the smoke test)
    python -m bench.privacy --plot docs/img/privacy_tradeoff.png
    python -m bench.privacy --from run.json --json [--plot P]   # summarize a saved run again
    python -m bench.privacy --list-defenses            # the cases: name -> [privacy] tables

Two tasks, each trained by a leader (labels, its bottom and the top) and one follower (its
bottom) in one process over the memory transport (`tandem.parties.split.SplitParty`, the
README's Python API), with the leakage audit on (`tandem.parties.privacy.audit`):

* ``imbalanced``: 20,000 rows (``--quick``: 2,000), 10 % positives, leader 5 and follower 10
  dense columns, MLP bottoms of cut 16, groups 1 (the setting of issue 40's report);
* ``ctr``: the click-through workload of `bench.ctr` (``--ctr-rows``, default 200,000;
  ``--quick``: 4,000) generated in memory: its dense columns (13 per party) and its labels
  (about 25 % positives). Its categorical columns are left out: their embedding tables would
  dominate the run time without changing what the cut gradients reveal about the labels.

For every case of `DEFENSES` (name -> ``[privacy]`` settings; ``"none"`` is the undefended
run) the task reports ``auc`` (test AUC after training), ``auc_delta`` (the undefended AUC
minus it: what the defense costs), ``norm_attack_auc`` and ``cosine_attack_auc`` (the label
audit of the last epoch: Li et al. 2022's norm and direction attacks on the gradients the
follower received), ``feature_r2`` (the follower's audit: a ridge decoder fitted on 1 % of its
rows reconstructs its features from the activations it sent, R^2 on the rest) and
``rows_per_second`` (training rows over training seconds).

Summary keys (on the ``imbalanced`` task): ``undefended_norm_attack_auc``,
``undefended_cosine_attack_auc``, ``best_label_defense`` (the defended case with the smallest
larger-of-both attack AUCs among those with ``auc_delta <= 0.01``, else overall: ``name``,
``norm_attack_auc``, ``cosine_attack_auc``, ``auc_delta``), ``best_feature_defense`` (smallest
``feature_r2`` likewise: ``name``, ``feature_r2``, ``auc_delta``; None when no defended case
ran), ``secure_sum_vs_plain`` (rows/s of the secure sum of two followers' cuts over the plain
sum, `bench.securesum.measure` with `SECURE_SUM`; None with ``--no-secure-sum``). ``load``: the
load average before and after.

``--defenses a,b`` runs only those cases of `DEFENSES` (and ``none``). ``--from FILE`` trains
nothing: it reads ``tasks`` (task -> case -> figures, as a run prints them, ``auc_delta`` not
needed) from the JSON in FILE and prints the summary keys and ``tasks`` for them (``--plot``
draws them). ``--list-defenses`` prints `DEFENSES` as one JSON line. Every case trains
``--epochs`` epochs (default 10: defended runs converge more slowly, and the figures compare
them at one training budget) with batch 256 and Adam at 1e-2, seed ``--seed``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import sys
import time
from typing import Any

import numpy as np
import orjson

from tandem.engine.kernels import mlp_stage
from tandem.engine.topology import leader_follower
from tandem.errors import ConfigError
from tandem.parties.privacy.audit import AuditSettings
from tandem.parties.privacy.config import privacy_from
from tandem.parties.split import SplitConfig, SplitParty
from tandem.transports.memory import MemoryNetwork

from . import ctr

#: Defense name -> the ``[privacy]`` tables of its case ("none": undefended); each defense at
#: three strengths, weakest first.
DEFENSES: dict[str, dict[str, Any]] = {
    "none": {},
    **{
        f"gradient_alignment_noise{n:g}": {"gradient_alignment": {"norm": 1.0, "noise": n}}
        for n in (1.0, 2.0, 4.0)
    },
    **{
        f"gradient_dp_nm{n:g}": {"gradient_dp": {"clip": 0.3, "noise_multiplier": n}}
        for n in (1.0, 1.5, 2.0)
    },
    **{
        f"label_dp_eps{e:g}": {"label_dp": {"epsilon": e, "prior": "uniform"}}
        for e in (4.0, 2.0, 1.0)
    },
    **{
        f"activation_dp_nm{n:g}": {"activation_dp": {"clip": 1.0, "noise_multiplier": n}}
        for n in (0.1, 0.2, 0.5)
    },
    **{f"nopeek_w{w:g}": {"nopeek": {"weight": w}} for w in (0.05, 0.1, 0.2)},
}
#: `bench.securesum.measure`'s arguments for ``secure_sum_vs_plain`` (None: not measured).
SECURE_SUM: dict[str, Any] | None = {"k": 2, "batches": 12, "repeats": 2}
#: An undefended run's test AUC may drop by this much for a defense to count as free.
AUC_BUDGET = 0.01
CUT = 16
HIDDEN = (64,)


@dataclasses.dataclass(frozen=True)
class Task:
    """A binary task split between a leader (``x_leader``, ``y``) and a follower
    (``x_follower``); the last ``test`` rows are held out."""

    name: str
    x_leader: np.ndarray
    x_follower: np.ndarray
    y: np.ndarray
    test: int

    def split(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return {"train": x[: -self.test], "test": x[-self.test :]}


def imbalanced(rows: int, seed: int = 0) -> Task:
    """``rows`` training rows (and a fifth as many test rows), 10 % positives: a logistic
    label of both parties' columns (the follower's carrying most of the signal)."""
    n = rows + rows // 5
    rng = np.random.default_rng([seed, 40])
    xl = rng.normal(size=(n, 5)).astype(np.float32)
    xf = rng.normal(size=(n, 10)).astype(np.float32)
    logit = xl @ rng.normal(size=5) * 0.5 + xf @ rng.normal(size=10) * 0.5
    logit = 1.5 * logit / logit.std()
    logit += ctr._bias_for_rate(logit, 0.10)
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return Task("imbalanced", xl, xf, y, n - rows)


def ctr_task(rows: int, seed: int = 0) -> Task:
    """The dense columns and labels of `bench.ctr`'s generating model for ``rows`` training
    rows (and a fifth as many test rows), drawn in memory."""
    n = rows + rows // 5
    work = ctr.Workload(rows=n, seed=seed, vocab=tuple(ctr.vocab_sizes(10, 1000)))
    cols = work.columns()
    draws = {p: ctr._draw_party(work, i, *cols[p]) for i, p in enumerate(work.parties)}
    logit = ctr.LOGIT_SCALE * sum(d.term for d in draws.values())
    logit += ctr._bias_for_rate(logit, ctr.POSITIVE_RATE)
    y = np.random.default_rng([seed, 99]).random(n) < 1 / (1 + np.exp(-logit))

    def dense(p: str) -> np.ndarray:
        return np.stack([draws[p].dense[j] for j in cols[p][0]], axis=1).astype(np.float32)

    return Task("ctr", dense("leader"), dense("follower"), y.astype(np.float32), n - rows)


def _party_options(privacy: dict[str, Any]) -> dict[str, Any]:
    """`SplitParty` keyword arguments of a case's ``[privacy]`` tables (beyond the audit);
    a fixed ``noise_seed`` so that the figures repeat (a real party leaves it unset)."""
    return {"privacy": privacy_from({"seed": 0, "noise_seed": 0, **privacy})}


async def run_case(
    task: Task, privacy: dict[str, Any], *, epochs: int, batch_size: int, seed: int = 0
) -> dict[str, Any]:
    """Train ``task`` with the ``privacy`` settings and the audit on; the case's figures."""
    topo = leader_follower()
    models = {
        "bottom_leader": mlp_stage([task.x_leader.shape[1]], list(HIDDEN), CUT),
        "bottom_follower": mlp_stage([task.x_follower.shape[1]], list(HIDDEN), CUT),
        "top": mlp_stage([CUT, CUT], [32], 1, activate_last=False),
    }
    cfg = SplitConfig(batch_size=batch_size, groups=1, learning_rate=1e-2, seed=seed)
    audit = AuditSettings(True, share=0.01, seed=seed)
    net = MemoryNetwork()
    options = {"config": cfg, "audit": audit, **_party_options(privacy)}
    leader = SplitParty(
        "leader",
        topo,
        models,
        net.endpoint("leader"),
        datasets=task.split(task.x_leader),
        labels=task.split(task.y),
        **options,
    )
    follower = SplitParty(
        "follower",
        topo,
        models,
        net.endpoint("follower"),
        datasets=task.split(task.x_follower),
        **options,
    )
    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        history = await leader.fit(epochs)
        metrics = await leader.evaluate("test")
        await leader.stop()
    assert leader.audit is not None and follower.audit is not None
    label, feature = leader.audit.summary(), follower.audit.summary()
    seconds = sum(e.seconds for e in history)
    return {
        "auc": metrics["auc"],
        "norm_attack_auc": label.get("audit_norm_auc"),
        "cosine_attack_auc": label.get("audit_cosine_auc"),
        "feature_r2": feature.get("audit_feature_r2"),
        "rows_per_second": epochs * len(task.y[: -task.test]) / seconds,
    }


def with_deltas(cases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each case with its ``auc_delta``: the undefended AUC minus its own (None if either is
    undefined)."""
    base = cases["none"]["auc"]
    for case in cases.values():
        auc = case["auc"]
        case["auc_delta"] = None if base is None or auc is None else base - auc
    return cases


def _best(cases: dict[str, dict[str, Any]], score, keys: tuple[str, ...]) -> dict | None:
    """The defended case with the lowest ``score`` among those within `AUC_BUDGET`, else the
    lowest overall; ``name`` and ``keys`` of it, or None without a defended case."""
    scored = [
        (name, c, s)
        for name, c in cases.items()
        if name != "none" and (s := score(c)) is not None and math.isfinite(s)
    ]
    if not scored:
        return None
    free = [x for x in scored if x[1]["auc_delta"] is not None and x[1]["auc_delta"] <= AUC_BUDGET]
    name, case, _ = min(free or scored, key=lambda x: x[2])
    return {"name": name, **{k: case[k] for k in keys}}


def _worst_attack(case: dict[str, Any]) -> float | None:
    both = [case["norm_attack_auc"], case["cosine_attack_auc"]]
    return None if None in both else max(both)


def summary(tasks: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The summary keys (see the module docstring) of the ``imbalanced`` task's cases."""
    cases = tasks["imbalanced"]
    return {
        "undefended_norm_attack_auc": cases["none"]["norm_attack_auc"],
        "undefended_cosine_attack_auc": cases["none"]["cosine_attack_auc"],
        "best_label_defense": _best(
            cases, _worst_attack, ("norm_attack_auc", "cosine_attack_auc", "auc_delta")
        ),
        "best_feature_defense": _best(
            cases, lambda c: c["feature_r2"], ("feature_r2", "auc_delta")
        ),
        "secure_sum_vs_plain": None,
    }


def secure_sum_ratio(**settings: Any) -> float:
    """``secure_sum_vs_plain`` of `bench.securesum.measure` with ``settings``: training rows
    per second of the followers' cuts summed securely over summed in the clear."""
    from . import securesum

    return float(securesum.measure(**settings)["secure_sum_vs_plain"])


def plot(tasks: dict[str, dict[str, dict[str, Any]]], path: str) -> None:
    """Draw each case's larger attack AUC against its ``auc_delta``, one panel per task."""
    from tandem._extras import needs

    with needs("plot", "bench.privacy --plot"):
        from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * len(tasks), 4))
    for ax, (task, cases) in zip(
        fig.subplots(1, len(tasks), squeeze=False)[0], tasks.items(), strict=True
    ):
        for name, case in cases.items():
            worst = _worst_attack(case)
            if worst is not None and case["auc_delta"] is not None:
                ax.scatter(case["auc_delta"], worst)
                ax.annotate(name, (case["auc_delta"], worst), fontsize=8)
        ax.axhline(0.6, ls="--", lw=0.8, color="grey")
        ax.axvline(AUC_BUDGET, ls="--", lw=0.8, color="grey")
        ax.set(title=task, xlabel="auc_delta (test AUC lost)", ylabel="label attack AUC (max)")
    fig.tight_layout()
    fig.savefig(path)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rows, ctr_rows = (2_000, 4_000) if args.quick else (args.rows, args.ctr_rows)
    epochs = 1 if args.quick else args.epochs
    load0 = os.getloadavg()
    tasks: dict[str, dict[str, dict[str, Any]]] = {}
    makers = {
        "imbalanced": lambda: imbalanced(rows, args.seed),
        "ctr": lambda: ctr_task(ctr_rows, args.seed),
    }
    chosen = args.tasks.split(",")
    if "imbalanced" not in chosen or set(chosen) - set(makers):
        raise ConfigError(
            f"--tasks must include imbalanced and name only {sorted(makers)}, got {args.tasks!r}"
        )
    for task in (makers[t]() for t in chosen):
        cases = {}
        for name, privacy in _chosen(args.defenses).items():
            t0 = time.perf_counter()
            cases[name] = await run_case(
                task, privacy, epochs=epochs, batch_size=args.batch_size, seed=args.seed
            )
            log(f"{task.name}/{name}: {cases[name]} ({time.perf_counter() - t0:.1f} s)")
        tasks[task.name] = with_deltas(cases)
    out = summary(tasks)
    if SECURE_SUM is not None and not args.no_secure_sum:
        settings = {"k": 2, "batches": 3, "repeats": 1} if args.quick else SECURE_SUM
        # bench.securesum runs its own jobs with asyncio.run: on a thread of its own
        out["secure_sum_vs_plain"] = await asyncio.to_thread(secure_sum_ratio, **settings)
    out = {
        **out,
        "tasks": tasks,
        "rows": {"imbalanced": rows, "ctr": ctr_rows if "ctr" in tasks else None},
        "epochs": epochs,
        "load": {"cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": os.getloadavg()},
    }
    if args.plot:
        plot(tasks, args.plot)
    return out


def resummarize(path: str, plot_path: str | None) -> dict[str, Any]:
    """The summary keys and ``tasks`` of the run saved in ``path`` (its JSON's ``tasks``),
    ``auc_delta`` recomputed; draws them into ``plot_path`` if given."""
    try:
        with open(path, "rb") as f:
            saved = orjson.loads(f.read())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ConfigError(f"--from {path}: cannot read a run's JSON ({exc})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("tasks"), dict):
        raise ConfigError(f"--from {path}: expected a JSON object with 'tasks' (a run's output)")
    tasks = {task: with_deltas(cases) for task, cases in saved["tasks"].items()}
    if plot_path:
        plot(tasks, plot_path)
    return {**summary(tasks), "tasks": tasks}


def _chosen(names: str | None) -> dict[str, dict[str, Any]]:
    """The `DEFENSES` cases ``names`` (comma-separated; "none" always runs) or all."""
    if names is None:
        return DEFENSES
    wanted = ["none", *(n for n in names.split(",") if n != "none")]
    unknown = sorted(set(wanted) - set(DEFENSES))
    if unknown:
        raise ConfigError(f"--defenses names unknown cases {unknown}; choose from {list(DEFENSES)}")
    return {n: DEFENSES[n] for n in wanted}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.privacy", description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON line on stdout")
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--rows", type=int, default=20_000, help="imbalanced task's training rows")
    p.add_argument("--ctr-rows", type=int, default=200_000, help="CTR task's training rows")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tasks", default="imbalanced,ctr", help="comma-separated tasks to run (imbalanced, ctr)"
    )
    p.add_argument("--no-secure-sum", action="store_true", help="skip the secure-sum measurement")
    p.add_argument("--defenses", help="comma-separated cases of DEFENSES to run (default all)")
    p.add_argument("--plot", help="draw attack AUC vs auc_delta into this picture")
    p.add_argument("--from", dest="saved", metavar="FILE", help="summarize a saved run's tasks")
    p.add_argument("--list-defenses", action="store_true", help="print DEFENSES as JSON")
    args = p.parse_args(argv)
    if args.list_defenses:
        sys.stdout.write(orjson.dumps(DEFENSES).decode() + "\n")
        return 0
    out = resummarize(args.saved, args.plot) if args.saved else asyncio.run(run(args))
    if args.json:
        sys.stdout.write(orjson.dumps(out).decode() + "\n")
    else:
        for task, cases in out["tasks"].items():
            for name, case in cases.items():
                log(f"{task:10s} {name:20s} {case}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
