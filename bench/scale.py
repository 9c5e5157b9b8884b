"""Split learning at scale: the click-through workload of `bench.ctr`, trained end to end
through the user's path, against the same model trained centrally.

``python -m bench.scale --json [--sizes 100k,1M,4M] [--followers 1] [--compress none]``
prints ONE JSON line on stdout (progress on stderr). For each size it:

1. generates the workload (`bench.ctr`: Parquet tables in row groups, cached in
   ``--work-dir/<rows>-k<followers>-s<seed>-v<vocab range>``);
2. aligns the parties with ``tandem align`` (one process per party, ids read from the Parquet
   files) when ``rows <= --align-max`` (``align_s``: the slowest party's time inside the PSI);
   larger sizes key the parties by id (every party holds every id);
3. trains with one ``tandem party`` process per party over HTTP on 127.0.0.1 (HMAC-signed):
   the parties read their Parquet tables, preprocess, negotiate, train ``--epochs`` epochs,
   validate, test and print their JSON line;
4. up to ``--reference-max`` rows (default 1M; above it these keys are null), trains the
   *same composed model* (the parties' bottoms and top, built from the same TOMLs,
   same initialisation keys, optimizer, batch size and batch order) in this process with plain
   JAX + optax on the same preprocessed data (`centralized`), and the leader's bottom + a top
   over it alone (`leader_only`).

**Per size** (``sizes[<rows>]``):

* ``rows_per_s``: training rows ÷ seconds of the last epoch, from the leader's history
  (``SplitParty.fit``'s epoch time: training batches only, no data loading, compilation (the
  first epoch has it) or validation); ``epoch_s`` the same seconds; ``load_s`` each party's
  reading and preprocessing time (its ``load_seconds``); ``wall_s`` the processes' wall time;
* ``rss_mb``: each party's peak resident set (``peak_rss_mb`` of its JSON line: its VmHWM);
  ``data_mb``: each party's *data bytes*: its rows × (dense columns as float32 + categorical
  columns as int32 codes) + the labels as float32 on the leader — the columns at their
  in-memory training dtype, every row it holds (training, validation and test); ``state_mb``:
  its parameters and optimizer state (float32 parameters, Adam's two moments: 3 × 4 bytes per
  parameter); ``rss_vs_data``: rss ÷ (data + state);
* ``params``: the parameter count of the whole model (per stage in ``params_by_stage``): the
  parties declare their columns' catalogs (``[data] vocabularies``), so the embedding tables
  have one row per category the workload can draw, and the model is the same at every size;
* ``auc_joint`` (the parties' ``test_auc``), ``auc_centralized``, ``auc_leader_only``, on the
  same test rows; ``centralized_rows_per_s`` (last epoch, like ``rows_per_s``);
  ``vs_centralized`` = rows_per_s ÷ centralized_rows_per_s;
* ``link_bytes``: bytes the leader sent plus received (all peers); with ``--compress X``
  (X != none) a second party run with ``[train] compress = X`` gives ``compressed``
  (``auc``, ``rows_per_s``, ``link_bytes``) and ``link_bytes_ratio`` = exact ÷ compressed.

**Top-level keys**: ``vs_centralized`` (at 1M rows; target >= 0.8), ``rows_per_s_4m_vs_100k``
(4M ÷ 100k; target >= 0.9), ``rss_vs_data`` (largest party ratio at the largest size; target
<= 2), ``auc_joint``, ``auc_leader_only`` and ``auc_vs_centralized`` (|joint - centralized|;
target <= 0.002) at the reference size (1M when run, else the largest), ``link_bytes_ratio``
there with ``--compress``; ``auto_vs_best_fixed`` (target >= 0.95) and
``first_epoch_vs_steady`` (target <= 1.3) at the reference size, and the same of the repeated
run, ``auto_vs_best_fixed_warm`` and ``first_epoch_vs_steady_warm``;
``auto_vs_best_fixed_all_epochs`` at the reference size; ``params``; ``loadavg``
(``os.getloadavg()`` at the end); ``cpus``. A size not run gives null for the keys that need it.

**The automatic count** (``--groups auto``, the default): up to ``--reference-max`` rows each
``--fixed`` count (default 1, 2, 4) trains too (same data and settings), and the size's entry
gets ``fixed_rows_per_s`` (each count's last epoch), ``best_fixed``, ``rows_per_s_all_epochs``
(the automatic run's rows over every epoch, the first with its compilations and the tuner's
search included), ``auto_vs_best_fixed`` = that ÷ the best fixed count's rows/s, and
``first_epoch_vs_steady`` = the first epoch's seconds ÷ the last's, and, like for like,
``fixed_first_epoch_vs_steady`` (each fixed count's) and ``auto_vs_best_fixed_all_epochs`` (the
automatic run's rows/s over every epoch ÷ the best fixed count's over every epoch, both
compiling from scratch: what the search costs beyond one count's compilations). The automatic
run starts on an empty compile cache (``[checkpoint] compile_cache`` in the size's folder), as
a job's first run on a machine does; up to ``--reference-max`` rows it then runs again on the
cache it left, as any later run of the job does (the kernels load from the cache, and the
leader starts at the count the first run settled on, `tandem.parties.split.process.tuned`):
the entry's ``warm`` gives that run's ``epoch_s``, ``rows_per_s``, ``n_groups``,
``rows_per_s_all_epochs``, ``first_epoch_vs_steady`` and ``auto_vs_best_fixed``. The fixed
counts run without a compile cache (their first epochs compile, as a first run's do), unless
``JAX_COMPILATION_CACHE_DIR`` names one; their last epochs compile nothing either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tandem.parties.progress import emit_result

from . import ctr

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_ROWS = 1_000_000


def parse_size(text: str) -> int:
    """``"100k"`` -> 100000, ``"4M"`` -> 4000000, ``"3000"`` -> 3000."""
    t = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(t[-1:], 1)
    number = t[:-1] if scale != 1 else t
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 100k, 1M, 3000)") from None
    if value < 100:
        raise argparse.ArgumentTypeError(f"size {text!r} is below 100 rows")
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class Settings:
    """How each size is run (`main`'s flags)."""

    followers: int = 1
    seed: int = 0
    batch_size: int = 4096
    epochs: int = 2
    learning_rate: float = 0.002
    #: the default "auto": the tuner picks n between batches; micro-batches run at bucketed
    #: sizes, so the counts it tries share their compiled kernels (docs/design.md)
    groups: int | str = "auto"
    #: with groups = "auto", the fixed counts also run (up to ``reference_max`` rows) for
    #: ``auto_vs_best_fixed``; () skips them
    fixed: tuple[int, ...] = (1, 2, 4)
    #: "one": party i's process (kernels included) is confined to CPU i mod cpus, so parties
    #: on one machine do not contend for its cores; "shared": each party's XLA uses every CPU
    #: (`party_launch`)
    party_threads: str = "one"
    compress: str = "none"
    #: the parties' ``[data] in_memory``: False (the default) maps their features from a file
    in_memory: bool = False
    align_max: int = 200_000
    reference_max: int = 1_000_000
    trace: bool = False
    #: time the kernels one by one after the runs (`breakdown`), up to ``reference_max`` rows
    breakdown: bool = True
    timeout: float = 1800.0
    vocab: tuple[int, ...] = tuple(ctr.vocab_sizes())

    def data_keys(self) -> dict[str, Any]:
        """The ``[data]`` keys the parties' TOMLs get on top of the workload's."""
        return {"in_memory": True} if self.in_memory else {}

    def train(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "groups": self.groups,
            "learning_rate": self.learning_rate,
            "seed": self.seed,
        }


def log(msg: str) -> None:
    """One progress line on stderr (stdout carries the JSON line only)."""
    from tandem.parties.progress import progress_bar

    with progress_bar(enabled=False) as bar:
        bar.console.print(f"bench.scale: {msg}", highlight=False, markup=False)


# -- processes -------------------------------------------------------------------------------
@dataclasses.dataclass
class Child:
    """One OS process, reaped by `poll`."""

    name: str
    popen: subprocess.Popen
    out: Path
    err: Path
    started: float
    rc: int | None = None
    ended: float = 0.0

    def poll(self) -> bool:
        if self.rc is not None:
            return True
        pid, status = os.waitpid(self.popen.pid, os.WNOHANG)
        if pid == 0:
            return False
        self.rc = os.waitstatus_to_exitcode(status)
        self.popen.returncode = self.rc
        self.ended = time.perf_counter()
        return True

    def result(self) -> dict[str, Any] | None:
        lines = [ln for ln in self.out.read_text().splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else None

    def tail(self) -> str:
        return self.err.read_text(errors="replace")[-3000:]


def launch(
    name: str, argv: list[str], folder: Path, env: dict[str, str], prefix: Sequence[str] = ()
) -> Child:
    """``tandem <argv>`` in ``folder`` (run under ``prefix``, e.g. ``taskset -c 0``), its
    output in ``<name>.out`` and ``<name>.err``."""
    out, err = folder / f"{name}.out", folder / f"{name}.err"
    with open(out, "wb") as fo, open(err, "wb") as fe:
        popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tandem", *argv],
            cwd=folder,
            stdout=fo,
            stderr=fe,
            env=env,
        )
    return Child(name, popen, out, err, time.perf_counter())


def wait_all(children: list[Child], timeout: float) -> None:
    """Wait for every child; on a failure or past ``timeout`` kill the rest and raise
    SystemExit naming the process and its stderr tail."""
    deadline = time.monotonic() + timeout
    try:
        while not all(c.poll() for c in children):
            failed = [c for c in children if c.rc not in (None, 0)]
            if failed or time.monotonic() > deadline:
                who = failed[0] if failed else next(c for c in children if c.rc is None)
                why = f"exited with {who.rc}" if failed else f"still running after {timeout} s"
                raise SystemExit(f"bench.scale: {who.name} {why}; its stderr:\n{who.tail()}")
            time.sleep(0.2)
        failed = [c for c in children if c.rc != 0]
        if failed:
            raise SystemExit(
                f"bench.scale: {failed[0].name} exited with {failed[0].rc}; its stderr:\n"
                f"{failed[0].tail()}"
            )
    finally:
        for c in children:
            if c.rc is None:
                c.popen.kill()
                c.poll() or c.popen.wait()


def child_env(secret: str) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "TANDEM_SECRET": secret,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""),
    }


#: XLA's CPU flag that runs each kernel on the thread that calls it (the party's compute lane)
#: instead of handing it to XLA's worker pool
ONE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"


def party_launch(
    env: dict[str, str], index: int, party_threads: str
) -> tuple[dict[str, str], list[str]]:
    """The environment and the command prefix of the ``index``-th party process.

    ``"shared"`` leaves both alone (XLA's thread pools use every CPU, as in a user's default
    run). ``"one"`` confines the whole process (XLA's worker pools, the event loop, the compute
    lanes) to CPU ``index`` mod the CPUs allowed, with ``taskset -c``, before it starts: XLA
    then sizes its pools to that one CPU, and with `ONE_THREAD_XLA_FLAGS` runs each kernel
    on the compute lane's own thread, so parties sharing a machine never contend for a core.
    """
    if party_threads == "shared":
        return env, []
    from tandem.parties.cli.affinity import thread_cpus

    taskset = shutil.which("taskset")
    if taskset is None:
        raise SystemExit(
            "bench.scale: --party-threads one pins each party with taskset (util-linux), which "
            "is not on PATH; install it or pass --party-threads shared"
        )
    cpus = sorted(thread_cpus())
    flags = " ".join(f for f in (env.get("XLA_FLAGS", ""), ONE_THREAD_XLA_FLAGS) if f)
    return {**env, "XLA_FLAGS": flags}, [taskset, "-c", str(cpus[index % len(cpus)])]


def launch_summary(runs: dict[str, tuple[dict[str, str], list[str]]]) -> dict[str, Any]:
    """Each party's `party_launch`, as the JSON reports it: ``cpu`` (None: not pinned) and
    ``xla_flags``."""
    return {
        p: {"cpu": prefix[-1] if prefix else None, "xla_flags": env.get("XLA_FLAGS")}
        for p, (env, prefix) in runs.items()
    }


def align(work: ctr.Workload, folder: Path, secret: str, timeout: float) -> float:
    """``tandem align`` for every party (ids from its Parquet file); the slowest party's
    seconds inside the alignment."""
    leader, followers = work.parties[0], work.parties[1:]
    ports = {p: free_port() for p in work.parties}
    env = child_env(secret)
    children = []
    for p in work.parties:
        peers = followers if p == leader else [leader]
        argv = ["align", "--name", p, "--role", "leader" if p == leader else "follower"]
        argv += ["--port", str(ports[p]), "--ids", f"{p}.parquet", "--column", "id"]
        argv += ["--out", f"{p}_aligned.csv", "--wait", "300"]
        for q in peers:
            argv += ["--peer", f"{q}=http://127.0.0.1:{ports[q]}"]
        children.append(launch(f"align_{p}", argv, folder, env))
    wait_all(children, timeout)
    summaries = [c.result() or {} for c in children]
    sizes = {s.get("intersection_size") for s in summaries}
    if sizes != {work.rows}:
        raise SystemExit(f"bench.scale: alignment kept {sizes} rows, expected {work.rows}")
    return max(float(s["seconds"]) for s in summaries)


def train_parties(
    work: ctr.Workload,
    folder: Path,
    settings: Settings,
    *,
    aligned: bool,
    secret: str,
    compress: str | None = None,
    tag: str = "",
    compile_cache: Path | None = None,
) -> dict[str, Any]:
    """One ``tandem party`` process per party; their JSON lines, peak RSS, wall seconds and
    the leader's history. ``compile_cache``: the folder the parties keep their compiled
    kernels in (one sub-folder each; None: the key's default, `ctr.party_toml`)."""
    urls = {p: f"http://127.0.0.1:{free_port()}" for p in work.parties}
    extra = {"compress": compress} if compress else None
    paths = ctr.write_configs(
        work,
        folder,
        urls=urls,
        train=settings.train(),
        aligned=aligned,
        extra_train=extra,
        extra_data=settings.data_keys(),
        compile_cache=None if compile_cache is None else str(compile_cache),
    )
    env = child_env(secret)
    runs = {p: party_launch(env, i, settings.party_threads) for i, p in enumerate(work.parties)}
    launched = launch_summary(runs)
    history = folder / f"history_{work.parties[0]}.jsonl"
    history.unlink(missing_ok=True)
    t0 = time.perf_counter()
    trace = ["--trace", str(folder / f"trace{tag}")] if settings.trace else []
    children = [
        launch(f"party_{p}{tag}", ["party", "--config", str(paths[p]), *trace], folder, *runs[p])
        for p in reversed(work.parties)
    ]
    wait_all(children, settings.timeout)
    results = {c.name.removeprefix("party_").removesuffix(tag): c.result() for c in children}
    for name, res in results.items():
        if not res or res.get("status") != "done":
            raise SystemExit(f"bench.scale: party {name} did not finish: {res}")
    epochs = [json.loads(line) for line in history.read_text().splitlines() if line.strip()]
    return {
        "results": results,
        # the party's own VmHWM: wait4's ru_maxrss would include this process's RSS at fork
        "rss_bytes": {
            name: int(res["peak_rss_mb"] * 2**20) for name, res in results.items() if res
        },
        "wall_s": time.perf_counter() - t0,
        "history": epochs,
        "launched": launched,
    }


def check_compress_supported(work: ctr.Workload, folder: Path, settings: Settings) -> None:
    """Refuse ``--compress`` before any run when this checkout's ``tandem party`` has no
    ``[train] compress`` key."""
    from tandem.errors import ConfigError
    from tandem.parties.split.process.party_config import load_party_config

    urls = {p: "http://127.0.0.1:1" for p in work.parties}
    probe = folder / "compress_probe"
    probe.mkdir(exist_ok=True)
    for p in work.parties:
        (probe / f"{p}.parquet").touch()
    paths = ctr.write_configs(
        work,
        probe,
        urls=urls,
        train=settings.train(),
        extra_train={"compress": settings.compress},
    )
    os.environ.setdefault("TANDEM_SECRET", "probe")
    try:
        load_party_config(paths[work.parties[0]])
    except ConfigError as exc:
        raise SystemExit(
            f"bench.scale: --compress {settings.compress}: this checkout's `tandem party` does "
            f"not accept [train] compress ({exc}); run without --compress, or on a branch with "
            "cut-layer compression"
        ) from None


# -- the centralized reference ------------------------------------------------------------------
def centralized(
    work: ctr.Workload, folder: Path, settings: Settings, *, train: bool = True
) -> dict[str, Any]:
    """The composed model and the leader-only model trained in this process (module
    docstring); data, models, initial parameters, optimizer and batches exactly as the
    parties build them from their TOMLs. Without ``train`` only the data is loaded and the
    models built (parameter counts, rows held); ``joint`` and ``leader_only`` are None."""
    import jax
    import jax.numpy as jnp
    import optax

    from tandem.engine.data import epoch_batches
    from tandem.engine.kernels import get_loss
    from tandem.parties.models import mlp
    from tandem.parties.split.metrics import roc_auc
    from tandem.parties.split.process.party_config import load_party_config
    from tandem.parties.split.stages import _stable_hash

    os.environ.setdefault("TANDEM_SECRET", "centralized")  # the TOMLs name it; nothing is sent
    configs = {p: load_party_config(folder / f"{p}.toml") for p in work.parties}
    data = {p: configs[p].load_data() for p in work.parties}
    leader = work.parties[0]
    topo = configs[leader].topology()
    top = topo.by_name["top"]
    models = {}
    for p in work.parties:
        stage = f"bottom_{p}"
        models[stage] = configs[p].stage_model(stage, [data[p].train.shape[1]], data[p].vocab)
    models["top"] = configs[leader].stage_model("top", [ctr.CUT] * len(top.inputs))
    models["top_alone"] = mlp([ctr.CUT], list(ctr.TOP_HIDDEN), 1, activate_last=False)
    key = jax.random.PRNGKey(settings.seed)
    init = {
        s: m.init(jax.random.fold_in(key, _stable_hash("top" if s == "top_alone" else s)))
        for s, m in models.items()
    }
    loss = get_loss("binary")
    y = data[leader].y_train
    y_test = data[leader].y_test
    n_params = {
        s: int(sum(np.size(a) for a in jax.tree_util.tree_leaves(init[s])))
        for s in models
        if s != "top_alone"
    }

    def run(stages: list[str], inputs: list[str]) -> dict[str, Any]:
        """Train ``stages`` (bottoms in the top's input order, then the top)."""
        bottoms, head = stages[:-1], stages[-1]
        optimizer = optax.adam(settings.learning_rate)
        params = {s: jax.tree_util.tree_map(jnp.array, init[s]) for s in stages}
        opt_state = optimizer.init(params)

        def forward(params, xs):
            zs = [models[b].apply(params[b], x) for b, x in zip(bottoms, xs, strict=True)]
            return models[head].apply(params[head], *zs)

        def objective(params, xs, labels):
            return jnp.sum(loss(forward(params, xs), labels)) / labels.shape[0]

        @jax.jit
        def step(params, opt_state, xs, labels):
            value, grads = jax.value_and_grad(objective)(params, xs, labels)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        predict = jax.jit(forward)
        seconds = []
        for epoch in range(settings.epochs):
            t0 = time.perf_counter()
            for idx in epoch_batches(len(y), settings.batch_size, epoch, settings.seed):
                xs = [data[p].train[idx] for p in inputs]
                params, opt_state, value = step(params, opt_state, xs, y[idx])
            jax.block_until_ready(params)
            seconds.append(time.perf_counter() - t0)
        scores = []
        for lo in range(0, len(y_test), settings.batch_size):
            xs = [data[p].test[lo : lo + settings.batch_size] for p in inputs]
            scores.append(np.asarray(predict(params, xs)).reshape(-1))
        auc = roc_auc(np.concatenate(scores), y_test)
        return {"rows_per_s": len(y) / seconds[-1], "epoch_s": seconds, "auc": auc}

    order = [str(s) for s in top.inputs]
    joint = alone = None
    if train:
        joint = run([*order, "top"], [s.removeprefix("bottom_") for s in order])
        alone = run([f"bottom_{leader}", "top_alone"], [leader])
    rows = {p: len(data[p].train) + len(data[p].test) + len(data[p].validation) for p in data}
    return {
        "joint": joint,
        "leader_only": alone,
        "params_by_stage": n_params,
        "rows_held": rows,
        "train_rows": len(y),
    }


# -- the kernel-by-kernel breakdown ---------------------------------------------------------
def breakdown(
    work: ctr.Workload, folder: Path, settings: Settings, groups: int, batch_s: float
) -> dict[str, Any]:
    """`bench.scale_kernels` for both sides: the parties' kernels in a process launched as
    party 0 is (`party_launch`: the same pinning and XLA flags) at ``groups`` groups, the
    centralized reference's in a process launched as this one runs it; plus what the
    figures mean together: ``lane_ms`` (the busiest party's kernels per batch: the critical
    path), ``centralized_step_ms``, ``kernels_vs_centralized`` (centralized step ÷ lane: the
    ``vs_centralized`` the pipeline would reach if nothing but kernels took time) and
    ``engine_ms`` (the run's last epoch per batch minus ``lane_ms``: the pipeline's waits,
    the transport and the engine; ``batch_s``: that epoch's seconds per batch), each by the
    wall clock and, for the kernels, the CPU clock. With ``--party-threads shared`` the
    parties start as this process does, so one process times both sides (``--which both``)."""
    env = child_env("breakdown")
    common = ["--parties", ",".join(work.parties), "--cut", str(ctr.CUT)]
    common += [
        "--batch-size",
        str(settings.batch_size),
        "--learning-rate",
        str(settings.learning_rate),
    ]
    runs = (
        [("both", (env, []))]
        if settings.party_threads == "shared"
        else [
            ("pipelined", party_launch(env, 0, settings.party_threads)),
            ("centralized", (env, [])),
        ]
    )
    sides = {}
    for which, (side_env, prefix) in runs:
        argv = [*prefix, sys.executable, "-m", "bench.scale_kernels", str(folder), "--which", which]
        argv += [*common, "--groups", str(groups)]
        done = subprocess.run(
            argv, capture_output=True, text=True, env=side_env, cwd=ROOT, timeout=settings.timeout
        )
        if done.returncode != 0:
            raise SystemExit(f"bench.scale: the {which} breakdown failed:\n{done.stderr[-3000:]}")
        out = json.loads(done.stdout.strip().splitlines()[-1])
        sides.update(out if which == "both" else {which: out})
    pipe, central = sides["pipelined"], sides["centralized"]
    lane = max(pipe["by_party_wall_ms"].values())
    lane_cpu = max(pipe["by_party_cpu_ms"].values())
    step, step_cpu = central["wall_ms"]["step"], central["cpu_ms"]["step"]
    batch_ms = 1e3 * batch_s
    return {
        "pipelined": pipe,
        "centralized": central,
        "lane_ms": round(lane, 3),
        "lane_cpu_ms": round(lane_cpu, 3),
        "centralized_step_ms": step,
        "centralized_step_cpu_ms": step_cpu,
        "kernels_vs_centralized": round(step / lane, 3),
        "kernels_vs_centralized_cpu": round(step_cpu / lane_cpu, 3),
        "batch_ms": round(batch_ms, 3),
        "engine_ms": round(batch_ms - lane, 3),
    }


# -- one size ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Prepared:
    """A size's workload, generated (cached in ``folder``) and aligned if ``aligned``."""

    work: ctr.Workload
    folder: Path
    manifest: dict[str, Any]
    aligned: bool
    align_s: float | None
    secret: str

    def train(self, settings: Settings, **kwargs: Any) -> dict[str, Any]:
        """`train_parties` on this workload."""
        return train_parties(
            self.work, self.folder, settings, aligned=self.aligned, secret=self.secret, **kwargs
        )


def prepare(rows: int, settings: Settings, work_dir: Path) -> Prepared:
    """Generate the size's workload unless cached, then align it up to ``align_max`` rows."""
    work = ctr.Workload(rows, settings.followers, settings.seed, vocab=settings.vocab)
    vocab = f"v{min(settings.vocab)}-{max(settings.vocab)}"
    folder = work_dir / f"{rows}-k{settings.followers}-s{settings.seed}-{vocab}"
    made = ["workload.json", *(f"{p}_vocabularies.json" for p in work.parties)]
    if not all((folder / name).exists() for name in made):
        log(f"{rows} rows: generating the workload in {folder}")
        t0 = time.perf_counter()
        ctr.generate(work, folder)
        log(f"{rows} rows: generated in {time.perf_counter() - t0:.1f} s")
    manifest = json.loads((folder / "workload.json").read_text())
    if settings.compress != "none":
        check_compress_supported(work, folder, settings)
    secret = secrets.token_hex(16)
    align_s = None
    aligned = rows <= settings.align_max
    if aligned:
        log(f"{rows} rows: tandem align ({len(work.parties)} processes)")
        align_s = align(work, folder, secret, settings.timeout)
        log(f"{rows} rows: aligned in {align_s:.1f} s")
    return Prepared(work, folder, manifest, aligned, align_s, secret)


def party_runs(rows: int, prep: Prepared, settings: Settings) -> dict[str, Any]:
    """The size's ``tandem party`` runs: ``exact`` (the settings, an empty compile cache),
    with ``groups = "auto"`` up to ``reference_max`` rows ``warm`` (the same run again with
    the cache the first left: a repeated or resumed run) and ``fixed`` (each ``--fixed``
    count's last epoch's seconds, the parties' default cache), and ``compressed`` with
    ``--compress``."""
    parties = len(prep.work.parties)
    log(f"{rows} rows: tandem party x {parties} over HTTP (an empty compile cache)")
    cache = prep.folder / "compile-cache"
    shutil.rmtree(cache, ignore_errors=True)
    exact = prep.train(settings, compile_cache=cache)
    lead, last = exact["results"][prep.work.parties[0]], exact["history"][-1]
    log(f"{rows} rows: trained, last epoch {last['seconds']:.1f} s, test auc {lead['test_auc']}")
    out: dict[str, Any] = {"exact": exact, "warm": None, "fixed": {}, "compressed": None}
    if settings.groups == "auto" and rows <= settings.reference_max:
        log(f"{rows} rows: again, with the compile cache the first run left (a repeated run)")
        out["warm"] = prep.train(settings, tag="_warm", compile_cache=cache)
        for k in settings.fixed:
            log(f"{rows} rows: again with the fixed groups = {k}")
            run = prep.train(dataclasses.replace(settings, groups=k), tag=f"_g{k}")
            out["fixed"][k] = [e["seconds"] for e in run["history"]]
    if settings.compress != "none":
        log(f"{rows} rows: again with [train] compress = {settings.compress!r}")
        out["compressed"] = prep.train(settings, compress=settings.compress, tag="_compressed")
    return out


def run_size(rows: int, settings: Settings, work_dir: Path) -> dict[str, Any]:
    """One size's entry of the JSON line (module docstring)."""
    prep = prepare(rows, settings, work_dir)
    work, folder = prep.work, prep.folder
    runs = party_runs(rows, prep, settings)
    exact, warm, compressed = runs["exact"], runs["warm"], runs["compressed"]
    lead, last = exact["results"][work.parties[0]], exact["history"][-1]
    reference = rows <= settings.reference_max
    log(
        f"{rows} rows: "
        + (
            "centralized reference (plain JAX + optax)"
            if reference
            else "loading the data for the byte counts (no centralized reference at this size)"
        )
    )
    ref = centralized(work, folder, settings, train=reference)
    kernels = None
    if reference and settings.breakdown:
        log(f"{rows} rows: the kernel-by-kernel breakdown (bench.scale_kernels)")
        groups = int(lead.get("n_groups") or 1)
        batches = math.ceil(ref["train_rows"] / settings.batch_size)
        kernels = breakdown(work, folder, settings, groups, last["seconds"] / batches)
    joint, alone = ref["joint"] or {}, ref["leader_only"] or {}
    train_rows = ref["train_rows"]
    rows_per_s = train_rows / last["seconds"]
    layout = work.columns()
    state_bytes = {
        p: 12 * ref["params_by_stage"][f"bottom_{p}"]
        + (12 * ref["params_by_stage"]["top"] if p == work.parties[0] else 0)
        for p in work.parties
    }
    data_bytes = {
        p: ref["rows_held"][p] * 4 * (len(layout[p][0]) + len(layout[p][1]))
        + (4 * ref["rows_held"][p] if p == work.parties[0] else 0)
        for p in work.parties
    }
    rss = exact["rss_bytes"]
    entry: dict[str, Any] = {
        "rows": rows,
        "train_rows": train_rows,
        "aligned_by": "tandem align" if prep.aligned else "id",
        "align_s": None if prep.align_s is None else round(prep.align_s, 2),
        "rows_per_s": round(rows_per_s, 1),
        "epoch_s": [round(e["seconds"], 3) for e in exact["history"]],
        "load_s": {p: r.get("load_seconds") for p, r in exact["results"].items()},
        "wall_s": round(exact["wall_s"], 2),
        "n_groups": lead.get("n_groups"),
        "launched": exact["launched"],
        "rss_mb": {p: round(v / 2**20, 1) for p, v in rss.items()},
        "data_mb": {p: round(v / 2**20, 1) for p, v in data_bytes.items()},
        "state_mb": {p: round(v / 2**20, 1) for p, v in state_bytes.items()},
        "rss_vs_data": {p: round(rss[p] / (data_bytes[p] + state_bytes[p]), 3) for p in rss},
        "params": sum(ref["params_by_stage"].values()),
        "params_by_stage": ref["params_by_stage"],
        "auc_joint": lead.get("test_auc"),
        "auc_centralized": joint.get("auc"),
        "auc_leader_only": alone.get("auc"),
        "bayes_auc": prep.manifest["bayes_auc"],
        "centralized_rows_per_s": round(joint["rows_per_s"], 1) if joint else None,
        "centralized_epoch_s": [round(s, 3) for s in joint.get("epoch_s", [])],
        "vs_centralized": round(rows_per_s / joint["rows_per_s"], 3) if joint else None,
        "link_bytes": _link_bytes(lead),
        "breakdown": kernels,
        **auto_figures([e["seconds"] for e in exact["history"]], train_rows, runs["fixed"]),
    }
    if warm is not None:
        entry["warm"] = warm_keys(warm, work.parties[0], train_rows, runs["fixed"])
    if compressed is not None:
        entry.update(compressed_keys(compressed, lead, work.parties[0], train_rows, settings))
    return entry


def warm_keys(
    warm: dict[str, Any], leader: str, train_rows: int, fixed: dict[int, Sequence[float]]
) -> dict[str, Any]:
    """The entry's ``warm``: the repeated run's epochs, last-epoch rows/s, count, and its
    `auto_figures` against the same fixed counts (not ``auto_vs_best_fixed_all_epochs``: the
    fixed counts' first epochs ran on an empty cache, this run's on a full one)."""
    epochs = [e["seconds"] for e in warm["history"]]
    figures = auto_figures(epochs, train_rows, fixed)
    return {
        "epoch_s": [round(s, 3) for s in epochs],
        "rows_per_s": round(train_rows / epochs[-1], 1),
        "n_groups": warm["results"][leader].get("n_groups"),
        **{
            k: figures[k]
            for k in ("first_epoch_vs_steady", "rows_per_s_all_epochs", "auto_vs_best_fixed")
        },
    }


def compressed_keys(
    compressed: dict[str, Any],
    lead: dict[str, Any],
    leader: str,
    train_rows: int,
    settings: Settings,
) -> dict[str, Any]:
    """The entry's ``compressed`` and ``link_bytes_ratio`` keys."""
    c_lead = compressed["results"][leader]
    out: dict[str, Any] = {
        "compress": settings.compress,
        "auc": c_lead.get("test_auc"),
        "rows_per_s": round(train_rows / compressed["history"][-1]["seconds"], 1),
        "link_bytes": _link_bytes(c_lead),
    }
    if c_lead.get("test_auc") is not None and lead.get("test_auc") is not None:
        out["auc_delta"] = round(c_lead["test_auc"] - lead["test_auc"], 5)
    return {
        "compressed": out,
        "link_bytes_ratio": round(_link_bytes(lead) / max(_link_bytes(c_lead), 1), 3),
    }


def auto_figures(
    epoch_s: Sequence[float], train_rows: int, fixed: dict[int, Sequence[float]]
) -> dict[str, Any]:
    """The automatic count's figures of a run with ``epoch_s`` (every epoch's seconds) over
    ``train_rows`` rows per epoch, against ``fixed`` (each fixed count's epochs' seconds):
    ``first_epoch_vs_steady`` (first epoch's seconds ÷ last's: compilation and the tuner's
    search), ``auto_vs_best_fixed`` (rows/s over every epoch, the first included, ÷ the best
    fixed count's rows/s in its last epoch), ``best_fixed`` and ``fixed_rows_per_s`` (last
    epochs); ``fixed_first_epoch_vs_steady`` (each fixed count's first epoch ÷ its last: what
    compiling one count costs) and ``auto_vs_best_fixed_all_epochs`` (rows/s over every epoch
    ÷ the best fixed count's over every epoch: with both runs compiling from scratch, the
    search's cost beyond the compilations any first run pays). The figures against the fixed
    counts are None without fixed runs."""
    auto = _rows_per_s_all_epochs(epoch_s, train_rows)
    last = {k: train_rows / s[-1] for k, s in fixed.items()}
    every = {k: _rows_per_s_all_epochs(s, train_rows) for k, s in fixed.items()}
    best = max(last, key=last.__getitem__, default=None)
    return {
        "first_epoch_vs_steady": round(epoch_s[0] / epoch_s[-1], 3),
        "rows_per_s_all_epochs": round(auto, 1),
        "fixed_rows_per_s": {str(k): round(v, 1) for k, v in sorted(last.items())},
        "best_fixed": best,
        "auto_vs_best_fixed": None if best is None else round(auto / last[best], 3),
        "fixed_first_epoch_vs_steady": {
            str(k): round(s[0] / s[-1], 3) for k, s in sorted(fixed.items())
        },
        "auto_vs_best_fixed_all_epochs": round(auto / max(every.values()), 3) if every else None,
    }


def _rows_per_s_all_epochs(epoch_s: Sequence[float], train_rows: int) -> float:
    """Rows per second over every epoch of a run, the first (with its compilations) included."""
    return len(epoch_s) * train_rows / sum(epoch_s)


def _link_bytes(result: dict[str, Any]) -> int:
    return sum(result.get("bytes_sent", {}).values()) + sum(
        result.get("bytes_received", {}).values()
    )


def summarize(entries: dict[int, dict[str, Any]], settings: Settings) -> dict[str, Any]:
    """The top-level keys of the JSON line (module docstring)."""
    ref_rows = REFERENCE_ROWS if REFERENCE_ROWS in entries else max(entries)
    ref = entries[ref_rows]
    biggest = entries[max(entries)]
    small, large = entries.get(100_000), entries.get(4_000_000)
    out: dict[str, Any] = {
        "bench": "scale",
        "transport": "http-loopback",
        "followers": settings.followers,
        "compress": settings.compress,
        "settings": dataclasses.asdict(settings) | {"vocab": None},
        "reference_rows": ref_rows,
        "vs_centralized": entries[REFERENCE_ROWS]["vs_centralized"]
        if REFERENCE_ROWS in entries
        else None,
        "rows_per_s_4m_vs_100k": round(large["rows_per_s"] / small["rows_per_s"], 3)
        if small and large
        else None,
        "rss_vs_data": max(biggest["rss_vs_data"].values()),
        "auto_vs_best_fixed": ref.get("auto_vs_best_fixed"),
        "first_epoch_vs_steady": ref.get("first_epoch_vs_steady"),
        "auto_vs_best_fixed_all_epochs": ref.get("auto_vs_best_fixed_all_epochs"),
        "auto_vs_best_fixed_warm": (ref.get("warm") or {}).get("auto_vs_best_fixed"),
        "first_epoch_vs_steady_warm": (ref.get("warm") or {}).get("first_epoch_vs_steady"),
        "auc_joint": ref["auc_joint"],
        "auc_centralized": ref["auc_centralized"],
        "auc_leader_only": ref["auc_leader_only"],
        "auc_vs_centralized": None
        if ref["auc_joint"] is None or ref["auc_centralized"] is None
        else round(abs(ref["auc_joint"] - ref["auc_centralized"]), 5),
        "params": ref["params"],
        "sizes": {str(k): v for k, v in sorted(entries.items())},
        "cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
    }
    if "link_bytes_ratio" in ref:
        out["link_bytes_ratio"] = ref["link_bytes_ratio"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the JSON line only (stdout)")
    ap.add_argument(
        "--sizes",
        type=lambda s: [parse_size(x) for x in s.split(",") if x.strip()],
        default=[100_000, 1_000_000],
        help="comma-separated row counts (default 100k,1M; add 4M for rows_per_s_4m_vs_100k)",
    )
    ap.add_argument("--followers", type=int, default=1, choices=(1, 2, 3))
    ap.add_argument(
        "--compress",
        default="none",
        choices=("none", "bfloat16", "int8", "topk"),
        help="also train with [train] compress = X and report link_bytes_ratio",
    )
    ap.add_argument("--batch-size", type=int, default=Settings.batch_size)
    ap.add_argument("--epochs", type=int, default=Settings.epochs)
    ap.add_argument("--learning-rate", type=float, default=Settings.learning_rate)
    ap.add_argument(
        "--groups",
        default="auto",
        help="micro-batches per batch: 'auto' (the default) or an int",
    )
    ap.add_argument(
        "--fixed",
        default=",".join(str(k) for k in Settings.fixed),
        help="with --groups auto: fixed counts also run up to --reference-max rows, for "
        "auto_vs_best_fixed (default 1,2,4; empty: none)",
    )
    ap.add_argument(
        "--align-max",
        type=parse_size,
        default=Settings.align_max,
        help="run `tandem align` up to this many rows (larger sizes key the parties by id)",
    )
    ap.add_argument(
        "--reference-max",
        type=parse_size,
        default=Settings.reference_max,
        help="train the centralized and leader-only references up to this many rows",
    )
    ap.add_argument("--vocab-max", type=int, default=100_000, help="largest vocabulary")
    ap.add_argument("--vocab-min", type=int, default=1_000, help="smallest vocabulary")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--print-launch",
        action="store_true",
        help="print how each party process would start (its CPU, its XLA_FLAGS) and exit",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="each party writes a Chrome trace of a few batches into <work dir>/<size>/trace",
    )
    ap.add_argument(
        "--party-threads",
        choices=("shared", "one"),
        default=Settings.party_threads,
        help="one (default): each party process, kernels included, runs on its own CPU "
        "(taskset); shared: each party's XLA uses every CPU",
    )
    ap.add_argument(
        "--in-memory",
        action="store_true",
        help="the parties hold their features in memory ([data] in_memory = true) instead "
        "of the default file mapping",
    )
    ap.add_argument(
        "--no-breakdown",
        action="store_true",
        help="skip the kernel-by-kernel breakdown (sizes[..].breakdown is then null)",
    )
    ap.add_argument("--timeout", type=float, default=Settings.timeout, help="seconds per run")
    ap.add_argument(
        "--work-dir",
        default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tandem-bench-scale"),
        help="where the generated workloads are cached",
    )
    args = ap.parse_args(argv)
    groups: int | str = args.groups if args.groups == "auto" else int(args.groups)
    settings = Settings(
        followers=args.followers,
        seed=args.seed,
        batch_size=args.batch_size,
        epochs=args.epochs,
        learning_rate=args.learning_rate,
        groups=groups,
        fixed=tuple(int(k) for k in args.fixed.split(",") if k.strip()),
        party_threads=args.party_threads,
        compress=args.compress,
        in_memory=args.in_memory,
        align_max=args.align_max,
        reference_max=args.reference_max,
        timeout=args.timeout,
        trace=args.trace,
        breakdown=not args.no_breakdown,
        vocab=tuple(ctr.vocab_sizes(args.vocab_min, args.vocab_max)),
    )
    parties = ctr.Workload(1, settings.followers, settings.seed).parties
    runs = {p: party_launch(dict(os.environ), i, args.party_threads) for i, p in enumerate(parties)}
    if args.print_launch:  # how the parties would start, and nothing else
        emit_result({"launched": launch_summary(runs)})
        return 0
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    entries = {}
    for rows in args.sizes:
        entries[rows] = run_size(rows, settings, work_dir)
        log(json.dumps(entries[rows]))
    emit_result(summarize(entries, settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
