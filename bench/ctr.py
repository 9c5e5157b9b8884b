"""A click-through-style workload for split learning: Parquet tables split by columns, and the
parties' TOML files.

``python -m bench.ctr --rows 1000000 --out DIR [--followers 1] [--seed 0] [--vocab 1000 100000]``
writes into DIR:

* ``leader.parquet``: ``id`` (text ``c00000000``...), ``label`` (0/1), dense ``I1``..``I13``
  (float32) and categorical ``C1``..``C13`` (int64 category values);
* ``follower.parquet`` (``--followers 1``: ``I14``..``I26``, ``C14``..``C26``), or
  ``follower1``..``follower3.parquet`` (``--followers 3``: those columns dealt round-robin);
* ``<party>_vocabularies.json``: every value each of the party's categorical columns can take
  (the catalog the values are drawn from), which its TOML declares (``[data] vocabularies``),
  so each embedding table has ``V_j + 1`` rows whatever rows a run trains on;
* ``<party>.toml`` for every party (`write_configs`) and ``workload.json`` (the `Workload`
  that made them: rows, vocabularies, seed, the Bayes-optimal AUCs of the generating model).

**Generating model.** Every party draws its own columns for all ``rows`` samples from
``(seed, party)``; a categorical column ``j`` with vocabulary ``V_j`` (26 sizes spaced
geometrically from 10^3 to 10^5) draws ranks with Zipf-like frequencies ``p_k ~ (k + 1)^-s``,
each rank mapped to a scrambled int64 category value. Each party contributes a term of unit
variance to the logit: a linear function of its dense columns plus a small interaction, and a
per-category effect (the "embedding" a model must learn) for each of its categorical columns.
The label is Bernoulli(sigmoid(scale * sum of terms + bias)), the bias set for a positive rate
near 25 %. So every party's columns matter and the leader alone sees only part of the signal.

**Files.** Each party's rows are stored in its own random order (only the ids line them up:
`tandem align`, or parties keyed by id) and written in row groups of ``row_group`` rows, so a
reader can stream them. Generation is vectorised numpy and pyarrow: no Python loop per row.
Every party holds every id (full overlap), so alignment keeps every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

N_DENSE = 26  # dense columns in all (I1..I26)
N_CATEGORICAL = 26  # categorical columns in all (C1..C26)
EMBED_DIM = 16
CUT = 64
BOTTOM_HIDDEN = (256, 128)
TOP_HIDDEN = (128, 64)
ROW_GROUP = 131_072
ZIPF_S = 0.95
POSITIVE_RATE = 0.25
LOGIT_SCALE = 1.2


def vocab_sizes(small: int = 1_000, large: int = 100_000, count: int = N_CATEGORICAL) -> list[int]:
    """``count`` vocabulary sizes spaced geometrically from ``small`` to ``large``."""
    if count == 1:
        return [small]
    ratio = (large / small) ** (1 / (count - 1))
    return [int(round(small * ratio**j)) for j in range(count)]


@dataclasses.dataclass(frozen=True)
class Workload:
    """What `generate` writes: ``rows`` samples, ``followers`` followers, per-column
    vocabularies ``vocab`` (category counts, code 0 not included), seeded by ``seed``."""

    rows: int
    followers: int = 1
    seed: int = 0
    vocab: tuple[int, ...] = tuple(vocab_sizes())
    row_group: int = ROW_GROUP
    zipf_s: float = ZIPF_S

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError(f"rows must be >= 1, got {self.rows}")
        if self.followers not in (1, 2, 3):
            raise ValueError(f"followers must be 1, 2 or 3, got {self.followers}")
        if len(self.vocab) != N_CATEGORICAL or min(self.vocab) < 2:
            raise ValueError(f"vocab needs {N_CATEGORICAL} sizes >= 2, got {self.vocab}")

    @property
    def parties(self) -> list[str]:
        """The leader first, then the followers."""
        if self.followers == 1:
            return ["leader", "follower"]
        return ["leader", *(f"follower{i + 1}" for i in range(self.followers))]

    def columns(self) -> dict[str, tuple[list[int], list[int]]]:
        """Per party: (dense column indices, categorical column indices), 0-based over the
        26 of each kind. The leader holds the first 13 of each kind (odd-sized vocabularies
        alternate between leader and followers so both hold small and large ones)."""
        cats = list(range(N_CATEGORICAL))
        leader_cats, follower_cats = cats[0::2], cats[1::2]
        dense = list(range(N_DENSE))
        out = {"leader": (dense[:13], leader_cats)}
        names = self.parties[1:]
        for i, name in enumerate(names):
            out[name] = (dense[13:][i :: len(names)], follower_cats[i :: len(names)])
        return out


def dense_name(j: int) -> str:
    return f"I{j + 1}"


def categorical_name(j: int) -> str:
    return f"C{j + 1}"


def make_ids(rows: int) -> Any:
    """``c%08d`` of 0..rows-1 as a pyarrow string array, built digit by digit (no Python loop
    per row). Needs ``rows <= 10**8``."""
    import pyarrow as pa

    if rows > 10**8:
        raise ValueError("ids have 8 digits: rows must be <= 10**8")
    n = np.arange(rows, dtype=np.int64)
    chars = np.empty((rows, 9), dtype=np.uint8)
    chars[:, 0] = ord("c")
    for pos in range(8, 0, -1):
        chars[:, pos] = ord("0") + n % 10
        n //= 10
    return pa.array(chars.view("S9").ravel()).cast(pa.string())


def _zipf_ranks(rng: np.random.Generator, vocab: int, rows: int, s: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** s
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(rows)), vocab - 1).astype(np.int32)


@dataclasses.dataclass
class _PartyDraw:
    dense: dict[int, np.ndarray]
    categorical: dict[int, np.ndarray]  # int64 category values
    catalog: dict[int, np.ndarray]  # every value column j can take (its declared vocabulary)
    term: np.ndarray  # this party's logit term, float64, unit variance


def _draw_party(work: Workload, party_index: int, dense: list[int], cats: list[int]) -> _PartyDraw:
    rng = np.random.default_rng([work.seed, party_index, 1])
    rows = work.rows
    out_dense: dict[int, np.ndarray] = {}
    linear = np.zeros(rows)
    weights = rng.normal(size=len(dense))
    for w, j in zip(weights, dense, strict=True):
        x = rng.normal(size=rows).astype(np.float32)
        out_dense[j] = x
        linear += w * x
    if len(dense) >= 2:
        linear += 0.75 * np.tanh(out_dense[dense[0]] * out_dense[dense[1]])
    linear /= max(linear.std(), 1e-9)
    effects = np.zeros(rows)
    out_cats: dict[int, np.ndarray] = {}
    catalog: dict[int, np.ndarray] = {}
    for j in cats:
        vocab = work.vocab[j]
        ranks = _zipf_ranks(rng, vocab, rows, work.zipf_s)
        effect = rng.normal(size=vocab)
        effects += effect[ranks]
        # scrambled category values: the rank is not the value's order
        values = rng.permutation(vocab).astype(np.int64) * 7919 + 1_000_003 * (j + 1)
        out_cats[j] = values[ranks]
        catalog[j] = values
    if cats:
        effects /= max(effects.std(), 1e-9)
    term = (linear + effects) / math.sqrt(2.0)
    return _PartyDraw(out_dense, out_cats, catalog, term)


def generate(work: Workload, out: Path) -> dict[str, Any]:
    """Write every party's Parquet table and ``workload.json`` into ``out``; returns the
    manifest (also ``workload.json``): the workload, each party's file and columns, the
    positive rate and the AUC of the generating probabilities (the best any model can reach
    in expectation, and with the leader's term alone)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    ids = make_ids(work.rows)
    layout = work.columns()
    draws = {p: _draw_party(work, i, *layout[p]) for i, p in enumerate(work.parties)}
    total = sum(d.term for d in draws.values())
    logit = LOGIT_SCALE * total / math.sqrt(len(draws) / 2)
    logit += _bias_for_rate(logit, POSITIVE_RATE)
    rng = np.random.default_rng([work.seed, 99])
    label = (rng.random(work.rows) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    files = {}
    for i, (party, draw) in enumerate(draws.items()):
        order = np.random.default_rng([work.seed, i, 2]).permutation(work.rows)
        columns: dict[str, Any] = {"id": ids}
        if party == "leader":
            columns["label"] = label
        for j in layout[party][0]:
            columns[dense_name(j)] = draw.dense[j]
        for j in layout[party][1]:
            columns[categorical_name(j)] = draw.categorical[j]
        path = out / f"{party}.parquet"
        schema = None
        with_writer = None
        try:
            for lo in range(0, work.rows, work.row_group):
                take = order[lo : lo + work.row_group]
                chunk = pa.table(
                    {
                        k: (
                            v.take(pa.array(take))
                            if isinstance(v, (pa.Array, pa.ChunkedArray))
                            else v[take]
                        )
                        for k, v in columns.items()
                    }
                )
                if with_writer is None:
                    schema = chunk.schema
                    with_writer = pq.ParquetWriter(path, schema)
                with_writer.write_table(chunk, row_group_size=work.row_group)
        finally:
            if with_writer is not None:
                with_writer.close()
        vocabularies = out / f"{party}_vocabularies.json"
        vocabularies.write_text(
            json.dumps({categorical_name(j): draw.catalog[j].tolist() for j in layout[party][1]})
        )
        files[party] = {
            "file": path.name,
            "vocabularies": vocabularies.name,
            "dense": [dense_name(j) for j in layout[party][0]],
            "categorical": [categorical_name(j) for j in layout[party][1]],
        }
        del draw
    from tandem.parties.split.metrics import roc_auc

    leader_logit = LOGIT_SCALE * draws["leader"].term
    manifest = {
        "workload": dataclasses.asdict(work),
        "parties": files,
        "positive_rate": float(label.mean()),
        "bayes_auc": roc_auc(logit, label),
        "bayes_auc_leader_term": roc_auc(leader_logit, label),
    }
    (out / "workload.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _bias_for_rate(logit: np.ndarray, rate: float) -> float:
    """The bias b with mean(sigmoid(logit + b)) ~= rate (bisection)."""
    lo, hi = -20.0, 20.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if np.mean(1 / (1 + np.exp(-(logit + mid)))) < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def party_toml(
    work: Workload,
    party: str,
    *,
    urls: dict[str, str],
    train: dict[str, Any],
    aligned: bool = False,
    extra_train: dict[str, Any] | None = None,
    extra_data: dict[str, Any] | None = None,
    compile_cache: str | None = None,
) -> str:
    """The TOML of ``party``: its table, the star topology (the leader has a bottom too),
    embedding (dim 16) + MLP bottoms with a cut of 64, an MLP top (leader), and ``train``
    (leader: ``batch_size``, ``epochs``, ``groups``, ``learning_rate``, ``seed``; plus
    ``extra_train`` keys, e.g. ``compress``; ``extra_data`` keys go to ``[data]``, e.g.
    ``in_memory``). ``urls`` maps every party to its base URL;
    ``aligned``: read ``<party>_aligned.csv`` (`tandem align --out`); ``compile_cache``: the
    party's ``[checkpoint] compile_cache`` folder (None: the key's default, which without a
    checkpoint folder is the environment's ``JAX_COMPILATION_CACHE_DIR`` if set, else none)."""
    leader = work.parties[0]
    followers = work.parties[1:]
    port = int(urls[party].rsplit(":", 1)[1])
    peers = followers if party == leader else [leader]
    cats = [categorical_name(j) for j in work.columns()[party][1]]
    lines = [
        f'role = "{"leader" if party == leader else "follower"}"',
        f'name = "{party}"',
        "progress = false",
        "wait = 300.0",
        "",
        "[listen]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "",
        "[peers]",
        *(f'{p} = "{urls[p]}"' for p in peers),
        "",
        "[security]",
        'secret_env = "TANDEM_SECRET"',
        "retry_timeout = 120.0",
        "peer_timeout = 120.0",
        "",
        "[data]",
        f'source = "{party}.parquet"',
        'id_column = "id"',
        *(['label_column = "label"'] if party == leader else []),
        "categorical = [" + ", ".join(f'"{c}"' for c in cats) + "]",
        f'vocabularies = "{party}_vocabularies.json"',
        *([f'aligned = "{party}_aligned.csv"'] if aligned else []),
        *(f"{k} = {json.dumps(v)}" for k, v in (extra_data or {}).items()),
        "",
        "[data.split]",
        "test = 0.1",
        "seed = 7",
        "",
        "[topology]",
        'kind = "star"',
        f'leader = "{leader}"',
        "followers = [" + ", ".join(f'"{f}"' for f in followers) + "]",
        "leader_bottom = true",
        "",
        "[model]",
        f"cut = {CUT}",
        "",
        f"[model.bottom_{party}]",
        'kind = "embedding"',
        f"dim = {EMBED_DIM}",
        f"hidden = {list(BOTTOM_HIDDEN)}",
        f"out = {CUT}",
    ]
    if party == leader:
        for f in followers:
            lines += ["", f"[model.bottom_{f}]", f"out = {CUT}"]
        lines += ["", "[model.top]", 'kind = "mlp"', f"hidden = {list(TOP_HIDDEN)}"]
        lines += ["", "[train]", 'loss = "binary"']
        for k, v in {**train, **(extra_train or {})}.items():
            lines.append(f"{k} = {json.dumps(v)}")
        lines += ["", "[log]", f'history = "history_{party}.jsonl"']
    if compile_cache is not None:
        lines += ["", "[checkpoint]", f"compile_cache = {json.dumps(compile_cache)}"]
    return "\n".join(lines) + "\n"


def write_configs(
    work: Workload,
    out: Path,
    *,
    urls: dict[str, str],
    train: dict[str, Any],
    aligned: bool = False,
    extra_train: dict[str, Any] | None = None,
    extra_data: dict[str, Any] | None = None,
    compile_cache: str | None = None,
) -> dict[str, Path]:
    """Write ``<party>.toml`` for every party into ``out`` (see `party_toml`); with a
    ``compile_cache`` folder, each party gets its own folder inside it."""
    paths = {}
    for p in work.parties:
        paths[p] = out / f"{p}.toml"
        paths[p].write_text(
            party_toml(
                work,
                p,
                urls=urls,
                train=train,
                aligned=aligned,
                extra_train=extra_train,
                extra_data=extra_data,
                compile_cache=None if compile_cache is None else str(Path(compile_cache) / p),
            )
        )
    return paths


DEFAULT_TRAIN = {
    "batch_size": 4096,
    "epochs": 2,
    "groups": "auto",
    "learning_rate": 0.002,
    "seed": 0,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ctr", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, required=True, help="samples (every party holds all)")
    ap.add_argument("--out", required=True, help="folder to write the tables and TOMLs into")
    ap.add_argument("--followers", type=int, default=1, choices=(1, 2, 3))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--row-group", type=int, default=ROW_GROUP, help="rows per Parquet row group")
    ap.add_argument(
        "--vocab",
        type=int,
        nargs=2,
        default=(1_000, 100_000),
        metavar=("SMALL", "LARGE"),
        help="the smallest and largest vocabulary (the 26 sizes are spaced geometrically)",
    )
    ap.add_argument(
        "--base-port", type=int, default=8801, help="the leader's port; +1 per follower"
    )
    args = ap.parse_args(argv)
    vocab = tuple(vocab_sizes(*args.vocab))
    work = Workload(args.rows, args.followers, args.seed, vocab=vocab, row_group=args.row_group)
    out = Path(args.out)
    manifest = generate(work, out)
    urls = {p: f"http://127.0.0.1:{args.base_port + i}" for i, p in enumerate(work.parties)}
    write_configs(work, out, urls=urls, train=DEFAULT_TRAIN)
    print(json.dumps({k: v for k, v in manifest.items() if k != "workload"}), file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
