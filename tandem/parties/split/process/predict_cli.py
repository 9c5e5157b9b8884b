"""``tandem predict``: cross-party inference with each party's own export, over HTTP.

Run one command per party, with the party TOML of its training (transport, peers, security,
topology; ``[train]`` is not used) and its NEW rows::

    tandem predict --config follower.toml --data new_f.csv
    tandem predict --config leader.toml   --data new_l.csv --out predictions.csv

Each party loads only its own export (``--export``, default the config's ``export_dir``) and
reads its rows the way its training did: an export of a ``[data]`` table carries the fitted
preprocessing state, which is applied to ``--data`` (a table: .csv, .parquet or .npz, at a
path or fsspec URL, `tandem.parties.data.load_new_data`); an export of pre-split arrays takes
a numeric matrix (.csv, .npy, .npz). Rows are paired across parties by id, never silently by
position:

* ``--aligned`` (the `tandem align --out` file of the new rows): those rows, in that order;
  where the rows have ids (a table, or ``--id-column``) each must be the id the file names;
* else ids (``--id-column``, or the training's id column): the rows sorted by id, and the
  parties must hold the same ids (the inference spec carries their size and commitment);
* else ``--positional`` states that every party's file holds the same samples in the same
  order; without it the command is refused.

Then it connects (`tandem.parties.split.process.session.connect`) and negotiates an inference spec
(`tandem.parties.split.inference`): same training id, topology, loss and cut widths; same
row count and the same alignment commitment. The leader writes the predictions (``.csv``:
``row[,id]`` then ``logit,probability`` for a binary loss, ``logit_k...,class`` for softmax,
``output_k...`` otherwise; ``.npy``: the raw outputs) and every party prints one JSON summary
line. What the preprocessing could not map as training did is counted per column: the JSON
line's ``filled_missing`` (empty cells filled in as ``data.missing`` said in training) and
``unseen_categories`` (values outside a categorical column's training vocabulary, given the
reserved code 0), each ``{column: count}``, and one warning line on stderr per affected
column. Errors go to stderr with exit code 2 (bad input: config, export, rows) or 1 (refused
negotiation, unreachable peer, timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import sys
import time
from typing import Any

import numpy as np

from tandem.parties.data import aligned_file
from tandem.parties.data.errors import AlignedFileError as AlignmentError
from tandem.parties.progress import emit_result

from ..inference import InferenceError, check_rows


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict",
        help="predict on new aligned rows across parties, each with "
        "its own export; the leader writes the predictions",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--config", required=True, help="this party's TOML (as for `tandem party`)")
    p.add_argument(
        "--export",
        help="this party's export: a .safetensors file or its folder "
        "(default: export_dir of the config)",
    )
    p.add_argument(
        "--data",
        help="new feature rows. An export trained on a [data] table reads a table with the "
        "training's columns: .csv (header row), .parquet, or .npz (one 1-D array per column), "
        "a path or an fsspec URL. An export trained on arrays reads a numeric matrix with the "
        "training's columns in order: .csv (header row), .npy, or .npz (array 'x')",
    )
    p.add_argument(
        "--id-column",
        help="the column of sample ids (never a feature): rows are keyed by id, and the "
        "predictions file gets an id column (default: the training's id column)",
    )
    p.add_argument(
        "--positional",
        action="store_true",
        help="pair rows with the other parties' by position (every party's file holds the "
        "same samples in the same order); only when the rows have no ids and no --aligned",
    )
    p.add_argument(
        "--aligned",
        help="the `tandem align --out` CSV of the new rows: predict "
        "those rows in that order; every party must give its file of the same "
        "alignment",
    )
    p.add_argument(
        "--rows",
        type=int,
        help="rows to predict, for a party whose stages read no features and that has no --aligned",
    )
    p.add_argument("--out", help="leader: where to write the predictions (.csv or .npy)")
    p.add_argument("--batch-size", type=int, default=256, help="leader: rows per batch")
    p.add_argument("--groups", type=int, default=1, help="leader: micro-batches per batch")
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="give up if prediction has not finished after this many seconds",
    )
    p.set_defaults(func=predict_command, colocate_threads=True)


async def predict_command(args: argparse.Namespace) -> int:
    """Exit codes (as `tandem party`): 0 done; 1 the run failed (spec refused, peer
    unreachable or lost, timeout); 2 bad input (config, export, rows, options)."""
    from tandem.errors import TandemError

    from .cli_report import report_error

    try:
        async with asyncio.timeout(args.timeout):
            summary = await run(args)
    except TimeoutError:
        print(
            f"tandem predict: not finished after {args.timeout:g} s; is every party running "
            "`tandem predict` with matching configs?",
            file=sys.stderr,
        )
        return 1
    except (TandemError, OSError, ExceptionGroup) as exc:
        return report_error("tandem predict", exc)
    emit_result(summary)
    return 0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Everything `predict_command` does but printing; returns the summary."""
    from .. import inference
    from . import cut_sum
    from .build import PartyData, load_party_config
    from .session import connected

    cfg = await asyncio.to_thread(load_party_config, args.config)
    export = args.export or cfg.export_dir
    if export is None:
        raise InferenceError(
            f"{cfg.path} sets no export_dir; pass --export with this party's .safetensors file"
        )
    model = await inference.load_model(export, cfg.name, topology=cfg.topology())
    await asyncio.to_thread(check_models, cfg, model)
    if model.is_leader and not args.out:
        raise InferenceError(
            "the leader writes the predictions: pass --out predictions.csv (or .npy)"
        )
    if args.out and not args.out.endswith((".csv", ".npy")):
        raise InferenceError(f"--out {args.out!r} must end in .csv or .npy")
    if args.batch_size < 1 or args.groups < 1:
        raise InferenceError("--batch-size and --groups must be >= 1")
    x, alignment, ids, counts = await asyncio.to_thread(read_inputs_counted, model, args, cfg)
    warn_counts(model.party, counts, (model.data or {}).get("preprocessing"))
    x, rows = await asyncio.to_thread(inference.prepare_rows, model, x, args.rows, alignment)
    data = PartyData(train=x, alignment=alignment)
    t0 = time.perf_counter()
    topo = model.topology
    if model.is_leader:
        spec = inference.inference_spec(
            model,
            rows=rows,
            batch_size=args.batch_size,
            groups=args.groups,
            alignment=alignment,
            security=cfg.security(),
        )
        proposal = cut_sum.with_cut_sum(cfg, spec)
        async with connected(cfg, data=data, spec=proposal) as session:
            cs = cut_sum.party_cut_sum(cfg, session.spec.hyper, topo)
            result = await inference.run_leader(session.transport, model, x, session.spec, cs)
        await asyncio.to_thread(write_predictions, args.out, result.outputs, model.loss, ids)
        extra: dict[str, Any] = {
            "out": args.out,
            "outputs": int(result.outputs.shape[1]),
            "digests": result.digests,
        }
    else:
        check = cut_sum.checking(
            cfg,
            topo,
            inference.inference_check(
                model, rows=rows, alignment=alignment, security=cfg.security()
            ),
        )
        describe = cut_sum.describing(cfg)
        async with connected(cfg, data=data, check=check, describe=describe) as session:
            cs = cut_sum.party_cut_sum(cfg, session.spec.hyper, topo)
            batches = await inference.run_follower(session.transport, model, x, session.spec, cs)
        extra = {"batches": batches}
    return {
        "command": "predict",
        "party": model.party,
        "role": "leader" if model.is_leader else "follower",
        "rows": rows,
        "training": model.training,
        "export": model.path,
        "export_digest": model.digest,
        "spec_hash": session.spec_hash,
        "filled_missing": {c: n["missing"] for c, n in counts.items() if n["missing"]},
        "unseen_categories": {c: n["unseen"] for c, n in counts.items() if n["unseen"]},
        **extra,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def warn_counts(
    party: str, counts: dict[str, dict[str, int]], state: dict[str, Any] | None
) -> None:
    """One stderr line per feature column with filled-in or unseen cells (`read_inputs_counted`)."""
    missing = (state or {}).get("missing")
    for column, n in counts.items():
        said = []
        if n["missing"]:
            how = "code 0" if column in _categorical(state) else f"data.missing = {missing!r}"
            said.append(f"{n['missing']} empty cell(s) filled in ({how}, as in training)")
        if n["unseen"]:
            said.append(f"{n['unseen']} value(s) not seen in training (code 0)")
        print(f"tandem predict ({party}): column {column!r}: " + "; ".join(said), file=sys.stderr)


def _categorical(state: dict[str, Any] | None) -> set[str]:
    return {str(c.get("name")) for c in (state or {}).get("categorical", [])}


# -- files ---------------------------------------------------------------------------------------
def read_inputs(model, args, cfg=None) -> tuple[np.ndarray | None, dict | None, list[str] | None]:
    """(rows, alignment ``{"size", "commitment"}`` or None, ids or None): the rows of
    ``--data`` as the training read them, keyed as the module docstring says."""
    return read_inputs_counted(model, args, cfg)[:3]


def read_inputs_counted(
    model, args, cfg=None
) -> tuple[np.ndarray | None, dict | None, list[str] | None, dict[str, dict[str, int]]]:
    """`read_inputs`, and the counts of `tandem.parties.data.NewData` (``{}`` for an export
    of arrays, which has no preprocessing to count)."""
    state = (model.data or {}).get("preprocessing")
    if state is not None:
        return _read_table(model, args, state, cfg)
    return (*_read_matrix(model, args), {})


def _read_matrix(model, args) -> tuple[np.ndarray | None, dict | None, list[str] | None]:
    x, ids = (None, None) if args.data is None else read_rows(args.data, args.id_column)
    if x is None and model.features is not None:
        raise InferenceError(
            f"{model.party!r} needs its new feature rows ({model.features} "
            "columns): pass --data new.csv"
        )
    x = check_rows(model, x, source=f"--data {args.data!r}")
    if args.aligned is None:
        if ids is not None:
            order, alignment = _keyed(ids)
            return (None if x is None else x[order]), alignment, [ids[i] for i in order]
        _refuse_positional(model, args)
        return x, None, None
    rows, aligned_ids, alignment = read_aligned(args.aligned)
    if x is not None:
        if len(rows) and int(rows.max()) >= len(x):
            raise InferenceError(
                f"--aligned {args.aligned!r} refers to row {int(rows.max())} "
                f"but --data {args.data!r} has {len(x)} rows; align the ids of "
                "this data file"
            )
        x = x[rows]
    if ids is not None:
        _check_aligned_ids(args, rows, ids, aligned_ids)
    return x, alignment, aligned_ids


def _check_aligned_ids(args, rows: np.ndarray, ids: list[str], aligned_ids: list[str]) -> None:
    """Refuse when ``--data`` no longer holds, at a row the ``--aligned`` file names, the id
    the file gives it (the data was reordered, filtered or edited after `tandem align`): its
    rows would be paired with the other parties' wrong samples."""
    for row, expected in zip(rows.tolist(), aligned_ids, strict=True):
        if row >= len(ids):
            raise InferenceError(
                f"--aligned {args.aligned!r} refers to row {row} but --data {args.data!r} "
                f"has {len(ids)} rows; align the ids of this data file"
            )
        if ids[row] != expected:
            raise InferenceError(
                f"--aligned {args.aligned!r} says row {row} of --data {args.data!r} has id "
                f"{expected!r}, but column {args.id_column!r} holds {ids[row]!r} there; "
                "run tandem align again on this file"
            )


def _read_table(
    model, args, state, cfg
) -> tuple[np.ndarray, dict | None, list[str] | None, dict[str, dict[str, int]]]:
    """Rows of an export trained on a ``[data]`` table: the saved preprocessing applied to
    ``--data``; keyed by ``--aligned``, else by the id column."""
    from tandem.parties.data import DataConfig, DataError, Preprocessing, load_new_data

    if args.data is None:
        raise InferenceError(
            f"{model.party!r} needs its new rows (the columns it was trained on): pass "
            "--data new.csv (or .parquet, .npz)"
        )
    try:
        preprocessing = Preprocessing.from_json(state)
    except DataError as exc:
        raise InferenceError(f"{model.path}: {exc}") from None
    if cfg is not None and cfg.data.table is not None:
        _check_preprocessing(cfg, model, preprocessing)
    id_column = args.id_column or preprocessing.id_column
    if id_column is None and args.aligned is None:
        _refuse_positional(model, args)
    table = DataConfig(source=args.data, id_column=id_column, aligned=args.aligned)
    try:
        new = load_new_data(table, preprocessing)
    except DataError as exc:
        raise InferenceError(f"--data {args.data!r}: {exc}") from None
    joined = np.concatenate(
        [new.features.numeric, new.features.categorical.astype(np.float32)], axis=1
    )
    x = check_rows(model, joined, source=f"--data {args.data!r}")
    if x is None:
        raise InferenceError(f"{model.party!r}'s stages read no features; leave out --data")
    ids = [str(i) for i in new.ids]
    if args.aligned is not None:
        return x, new.alignment, ids, new.counts
    if id_column is None:
        return x, None, None, new.counts
    order, alignment = _keyed(ids)
    return x[order], alignment, [ids[i] for i in order], new.counts


def check_models(cfg, model) -> None:
    """Refuse when a ``[model.<stage>]`` table of the config describes another model than the
    export holds for that stage (another factory, kwargs, kind or widths): the export's model
    is what predicts, so a differing config means another training was meant."""
    state = (model.data or {}).get("preprocessing") or {}
    vocab = [
        int(c.get("buckets") or len(c["vocabulary"])) + 1 for c in state.get("categorical", [])
    ]
    reasons = []
    for stage in model.topology.stages_of(model.party):
        if stage.name not in cfg.model.stages:
            continue
        exported = model.models[stage.name]
        try:
            configured = cfg.stage_model(stage.name, exported.in_dims, vocab)
        except Exception as exc:  # noqa: BLE001 - any failure to build is a reason to refuse
            reasons.append(f"stage {stage.name!r}: [model.{stage.name}] does not build: {exc}")
            continue
        if _plain(configured.spec) != _plain(exported.spec):
            reasons.append(
                f"stage {stage.name!r}: the export holds {_plain(exported.spec)} but "
                f"[model.{stage.name}] describes {_plain(configured.spec)}"
            )
    if reasons:
        raise InferenceError(
            f"{model.path} does not hold the model {cfg.path} describes: "
            + "; ".join(reasons)
            + ". Predict with the config and export of the same training, or train again"
        )


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True))


def _check_preprocessing(cfg, model, state) -> None:
    """Refuse when the party's [data] asks for another preprocessing than its export holds
    (prediction applies the export's; a differing config means another model was meant)."""
    table, reasons = cfg.data.table, []
    given = {
        "categorical": sorted(table.categorical),
        "missing": table.missing,
        "scale": table.scale,
        "id_column": table.id_column,
    }
    trained = {
        "categorical": sorted(state.categorical),
        "missing": state.missing,
        "scale": state.scale,
        "id_column": state.id_column,
    }
    if table.features is not None:
        given["features"] = sorted(table.features)
        trained["features"] = sorted(state.columns)
    for key, value in given.items():
        if value != trained[key]:
            reasons.append(
                f"data.{key} is {value!r} in {cfg.path} but {trained[key]!r} in training"
            )
    if reasons:
        raise InferenceError(
            f"the export {model.path} was trained with another preprocessing than "
            f"{cfg.path} describes: " + "; ".join(reasons) + ". Predict with the config and "
            "export of the same training, or train again"
        )


def _keyed(ids: list[str]) -> tuple[np.ndarray, dict[str, Any]]:
    """The order sorting ``ids`` by canonical id (the order `tandem align` agrees on), and
    ``{"size", "commitment"}`` of the sorted ids."""
    from tandem.parties.data.canonical_ids import canonical, commitment

    keys = [canonical(i) for i in ids]
    first: dict[bytes, int] = {}
    for i, k in enumerate(keys):
        if first.setdefault(k, i) != i:
            raise InferenceError(
                f"id {ids[i]!r} occurs twice in the new rows (rows {first[k]} and {i}); ids "
                "must be unique to key rows by id"
            )
    order = np.array(sorted(range(len(ids)), key=keys.__getitem__), dtype=np.int64)
    return order, {"size": len(ids), "commitment": commitment(keys[i] for i in order)}


def _refuse_positional(model, args) -> None:
    if not getattr(args, "positional", False):
        raise InferenceError(
            f"{model.party!r}'s rows have no ids and no --aligned file, so they would be paired "
            "with the other parties' by file position; pass --aligned (the `tandem align --out` "
            "file of these rows) or --id-column NAME on every party, or --positional if every "
            "party's file holds the same samples in the same order"
        )


def read_rows(path: str, id_column: str | None = None) -> tuple[np.ndarray, list[str] | None]:
    """A float matrix from ``.csv`` (header row; ``id_column`` read as the ids, not a
    feature), ``.npy`` or ``.npz``, and the ids (None without ``id_column``)."""
    if not os.path.isfile(path):
        raise InferenceError(f"--data {path!r}: no such file")
    if not path.endswith(".csv") and id_column is not None:
        raise InferenceError(
            f"--id-column names a column, but --data {path!r} is a bare matrix; give a .csv "
            "with a header row"
        )
    if path.endswith(".npy"):
        return np.load(path, allow_pickle=False), None
    if path.endswith(".npz"):
        with np.load(path, allow_pickle=False) as z:
            if "x" in z.files or len(z.files) == 1:
                return np.asarray(z["x" if "x" in z.files else z.files[0]]), None
            raise InferenceError(
                f"--data {path!r} holds arrays {sorted(z.files)}; name the feature rows 'x'"
            )
    if not path.endswith(".csv"):
        raise InferenceError(f"--data {path!r} must be a .csv, .npy or .npz file")
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise InferenceError(f"--data {path!r} is empty; expected a header row, then rows")
        drop = None
        if id_column is not None:
            if id_column not in header:
                raise InferenceError(
                    f"--id-column {id_column!r} is not a column of {path!r} (columns: {header})"
                )
            drop = header.index(id_column)
        table, ids = [], []
        for line, row in enumerate(reader, start=2):
            if len(row) != len(header):
                raise InferenceError(
                    f"--data {path!r} line {line} has {len(row)} values; the "
                    f"header has {len(header)}"
                )
            try:
                table.append([float(v) for i, v in enumerate(row) if i != drop])
            except ValueError:
                raise InferenceError(
                    f"--data {path!r} line {line} has a non-numeric value; "
                    "feature CSVs hold numbers only (name an id column with "
                    "--id-column)"
                ) from None
            if drop is not None:
                ids.append(row[drop])
    x = np.asarray(table, np.float64).reshape(len(table), len(header) - (drop is not None))
    return x, (ids if drop is not None else None)


def read_aligned(path: str) -> tuple[np.ndarray, list[str], dict[str, Any]]:
    """(row indices, ids, ``{"size", "commitment"}``) of a `tandem align --out` CSV."""
    try:
        aligned = aligned_file.read_aligned(path)
    except AlignmentError as exc:
        raise InferenceError(f"--aligned: {exc}") from None
    return aligned.rows, aligned.ids, aligned.spec_fields()


def write_predictions(
    path: str, out: np.ndarray, loss: str | None, ids: list[str] | None = None
) -> None:
    """Write the loss stage's outputs (see the module docstring for the columns)."""
    out = np.asarray(out, np.float32).reshape(len(out), -1)
    if path.endswith(".npy"):
        np.save(path, out, allow_pickle=False)
        return
    k = out.shape[1]
    if loss == "binary" and k == 1:
        names = ["logit", "probability"]
        table = np.concatenate([out, 1.0 / (1.0 + np.exp(-out.astype(np.float64)))], axis=1)
    elif loss == "softmax":
        names = [f"logit_{j}" for j in range(k)] + ["class"]
        table = np.concatenate([out, out.argmax(axis=1)[:, None]], axis=1)
    else:
        names = [f"output_{j}" for j in range(k)]
        table = out
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["row"] + (["id"] if ids is not None else []) + names)
        for i, values in enumerate(table.tolist()):
            w.writerow(
                [i]
                + ([ids[i]] if ids is not None else [])
                + [_fmt(v, n) for v, n in zip(values, names, strict=True)]
            )


def _fmt(value: float, name: str) -> str:
    return str(int(value)) if name == "class" else repr(float(np.float32(value)))
