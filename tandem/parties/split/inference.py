"""Cross-party inference: each party loads only its own export and predicts with its peers.

A party's export (`export_party`: a `tandem.parties.export` stages file with the stages'
model specs, the output width of every stage, the training id and the loss) is all it needs:
`load_model(path, party)` (`tandem.parties.export.model`, re-exported here) rebuilds its own
stages from that file alone. Then::

    leader (owns the loss stage)                     every follower
    m = await load_model("leader.safetensors")       m = await load_model("follower.safetensors")
    res = await predict(transport, m, x_new)         await serve(transport, m, x_new)
    res.outputs  # [rows, out] float32

Negotiation (`tandem.parties.split.negotiate`, before any compute): the leader proposes an inference
`TaskSpec` (``hyper.task = "predict"``, no optimizer, 0 epochs) carrying its export's training
id, topology, loss and stage widths, the number of rows to predict and their alignment
commitment. A follower refuses, with one readable sentence per problem, if its own export comes
from another training, topology, loss or cut widths, or if its rows differ in count or
commitment; both sides then raise `NegotiationError` and nothing is computed. A training
proposal sent to a predicting follower (or the reverse) is refused the same way. Once a
follower has accepted, it sends the leader its own model description (``{"cmd": "model",
"training", "digest", "widths", "topology"}``), which the leader checks in turn (`confirm`):
both sides verify, and the leader's result names every party's export digest.

What crosses the wire: the negotiation and model descriptions (ids, digests, widths), the
leader's batch commands (row indices into the new rows) and cut-layer activations along the
topology's edges; never parameters, features or labels. Only the label owner computes the
predictions (raw outputs of the loss stage).

Contract: files are read and written in worker threads and compute runs on each party's lane,
so the event loop never blocks; nothing here creates a loop or leaves a task running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tandem.parties.export import save_stages
from tandem.parties.export.model import (
    InferenceError,
    PartyModel,
    brief_topology,
    load_model,
    load_model_sync,
    resolve_export,
)
from tandem.transports.base import Frame, Transport

from ..privacy.securesum import CutSum
from . import negotiate
from .negotiate import NegotiationError
from .party import SplitConfig, SplitParty
from .spec import TaskSpec, cut_fields, cut_of, spec_edges

DATASET = "predict"
#: Security fields recorded when the caller gives none (in-process transports enforce none).
NO_SECURITY = {"auth": "none", "tls": False, "max_frame_bytes": 0, "reject_nonfinite": False}


# -- export --------------------------------------------------------------------------------------
async def export_party(
    party: SplitParty, path: str | os.PathLike, *, data: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Save ``party``'s own stages with what `load_model` needs; returns the description.

    Records each stage's model spec, the output width of every stage of the topology, the
    training id (``party.run_id``: the leader's, adopted by followers from its commands), on
    the loss stage's owner the loss, and ``data`` (``{"preprocessing", "fingerprint"}`` of
    the training data, which `tandem predict` applies to new rows). Raises `InferenceError`
    before training has run.
    """
    if party.run_id is None:
        raise InferenceError(
            f"{party.name!r} has no training id yet (a follower adopts the "
            "leader's from its commands): export after training"
        )
    missing = [s.name for s in party.topology.stages if s.name not in party.handler.out_dims]
    if missing:
        raise InferenceError(
            f"{party.name!r} does not know the widths of stages {missing}; "
            "build it with a StageModel for every stage of the topology"
        )
    specs = {s: m.spec for s, m in party.handler.models.items()}
    handler = party.handler
    cuts = {
        s: {"shape": list(handler.cut_shape(s)), "dtype": handler.out_dtypes[s]}
        for s in handler.out_dims
        if len(handler.cut_shape(s)) > 1 or handler.out_dtypes[s] != "float32"
    }
    if any(v is None for v in specs.values()):
        raise InferenceError(
            f"stages {[s for s, v in specs.items() if v is None]} of "
            f"{party.name!r} have no model spec, so an export could not rebuild them: build "
            "them with tandem.parties.models (mlp, embedding_mlp, load_factory, or an "
            "adapter given reference='package.module:function'; see docs/models.md)"
        )
    params = party.params  # a copy, taken now: an update running meanwhile donates the originals
    return await asyncio.to_thread(
        _save,
        path,
        params,
        topology=party.topology.to_dict(),
        party=party.name,
        models=specs,
        widths=dict(party.handler.out_dims),
        training=party.run_id,
        loss=party.config.loss if party.is_leader else None,
        data=data,
        cuts=cuts or None,  # recorded only when a cut is not a float32 matrix
    )


def _save(path, params, **fields) -> dict[str, Any]:
    import jax

    host = {s: jax.tree_util.tree_map(np.asarray, p) for s, p in params.items()}
    return save_stages(path, host, **fields)


# -- rows ----------------------------------------------------------------------------------------
def check_rows(model: PartyModel, x: np.ndarray | None, *, source: str = "x") -> np.ndarray | None:
    """``x`` as float32 after checking it fits ``model`` (2-D, the exported feature count, all
    finite); `InferenceError` naming ``source`` and the fix otherwise."""
    want = model.features
    if want is None:
        if x is not None:
            raise InferenceError(
                f"{model.party!r}'s stages read no features, but {source} was given; leave it out"
            )
        return None
    if x is None:
        raise InferenceError(
            f"{model.party!r} needs its feature rows ({want} columns) to predict; pass them"
        )
    x = np.asarray(x)
    if x.ndim != 2:
        raise InferenceError(
            f"{source}: expected a 2-D array of rows x {want} features, got shape {list(x.shape)}"
        )
    if x.shape[1] != want:
        raise InferenceError(
            f"{source} has {x.shape[1]} feature columns but {model.party!r}'s "
            f"model was trained on {want} (export {model.path}); give the same "
            "columns, in the same order, as in training"
        )
    if x.dtype.kind not in "biuf":
        raise InferenceError(f"{source}: features must be numbers, got dtype {x.dtype}")
    x = x.astype(np.float32)
    bad = np.argwhere(~np.isfinite(x))
    if len(bad):
        r, c = (int(v) for v in bad[0])
        raise InferenceError(
            f"{source} has {len(bad)} non-finite values (NaN or Inf), the first "
            f"at row {r}, column {c}; impute or drop those rows on every party"
        )
    return x


# -- negotiation ---------------------------------------------------------------------------------
def inference_spec(
    model: PartyModel,
    *,
    rows: int,
    batch_size: int = 256,
    groups: int = 1,
    alignment: Mapping[str, Any] | None = None,
    security: Mapping[str, Any] | None = None,
    config: SplitConfig | None = None,
) -> TaskSpec:
    """The leader's proposal: predict ``rows`` rows with the model of ``model.training``."""
    cfg = config or SplitConfig()
    topo = model.topology
    datasets = (
        {}
        if model.features is None
        else {model.party: {"features": model.features, "dtype": "float32"}}
    )
    stages = {
        s.name: {
            "owner": s.owner,
            "out_dim": model.widths[s.name],
            **cut_fields(s.name, _widths_entry(model, s.name)),
        }
        for s in topo.stages
    }
    edges = spec_edges(topo, stages)
    hyper = {
        "task": "predict",
        "training": model.training,
        "loss": model.loss,
        "batch_size": int(batch_size),
        "eval_batch_size": int(batch_size),
        "groups": int(groups),
        "learning_rate": None,
        "optimizer": None,
        "epochs": 0,
        "checkpoint_every": 0,
        "seed": cfg.seed,
        "threshold": cfg.threshold,
        "capacity": cfg.capacity,
        "policy": cfg.policy,
    }
    return TaskSpec(
        topology=topo.to_dict(),
        datasets=datasets,
        samples=int(rows),
        stages=stages,
        edges=edges,
        hyper=hyper,
        security=dict(security or NO_SECURITY),
        alignment=None
        if alignment is None
        else {"size": int(alignment["size"]), "commitment": str(alignment["commitment"])},
    )


def _widths_entry(model: PartyModel, stage: str) -> dict[str, Any]:
    cut = model.cut_of(stage)
    return {"out_dim": model.widths[stage], "out_shape": cut["shape"], "out_dtype": cut["dtype"]}


def inference_check(
    model: PartyModel,
    *,
    rows: int,
    alignment: Mapping[str, Any] | None = None,
    security: Mapping[str, Any] | None = None,
) -> Callable[[TaskSpec], list[str]]:
    """A follower's ``check(spec) -> reasons`` ([] = accept) against its own export and rows."""
    me, mine = repr(model.party), f"the export of {model.party!r}"

    def check(spec: TaskSpec) -> list[str]:
        hyper = spec.hyper
        if hyper.get("task") != "predict":
            return [
                f"the leader proposes training, but {me} runs `tandem predict`; run the "
                "same command on every party"
            ]
        reasons = []
        if _plain(spec.topology) != _plain(model.topology.to_dict()):
            reasons.append(
                f"the leader's model has topology {brief_topology(spec.topology)} but {mine} "
                f"has {brief_topology(model.topology)}"
            )
        if hyper.get("training") != model.training:
            reasons.append(
                f"the exports come from different trainings: the leader's has training id "
                f"{hyper.get('training')!r}, {mine} ({model.path}) has {model.training!r}; give "
                "every party its export of the same training run"
            )
        if model.loss is not None and hyper.get("loss") != model.loss:
            reasons.append(
                f"the leader's model was trained with loss {hyper.get('loss')!r} "
                f"but {mine} with {model.loss!r}"
            )
        reasons += _width_reasons(spec, model)
        if int(spec.samples) != int(rows):
            reasons.append(
                f"the leader predicts {spec.samples} rows but {me} holds {rows}; "
                "give every party the same (aligned) rows"
            )
        reasons += _alignment_reasons(spec.alignment, alignment, me)
        for key, value in (security or {}).items():
            if spec.security.get(key) != value:
                reasons.append(
                    f"security setting {key!r}: {me} uses {value!r} but the leader "
                    f"{spec.security.get(key)!r}"
                )
        return reasons

    return check


def _width_reasons(spec: TaskSpec, model: PartyModel) -> list[str]:
    """`inference_check`: each stage's width, cut shape and dtype, the leader's against the
    export's."""
    mine, reasons = f"the export of {model.party!r}", []
    for name, st in spec.stages.items():
        if name in model.widths and int(st.get("out_dim", -1)) != model.widths[name]:
            reasons.append(
                f"stage {name!r} outputs {st.get('out_dim')} columns in the "
                f"leader's export but {model.widths[name]} in {mine}"
            )
        elif name in model.widths:
            (theirs_shape, theirs_dtype), cut = cut_of(st), model.cut_of(name)
            if [theirs_shape, theirs_dtype] != [cut["shape"], cut["dtype"]]:
                reasons.append(
                    f"stage {name!r} outputs {theirs_dtype}[rows, {_dims(theirs_shape)}] in "
                    f"the leader's export but {cut['dtype']}[rows, {_dims(cut['shape'])}] "
                    f"in {mine}"
                )
    return reasons


def _alignment_reasons(
    theirs: Mapping[str, Any] | None, alignment: Mapping[str, Any] | None, me: str
) -> list[str]:
    """`inference_check`: the leader's alignment commitment against this party's."""
    if (theirs is None) != (alignment is None):
        who = "the leader" if theirs is not None else me
        return [
            f"only {who} gave an aligned-ids file (or keyed its rows by id); give every "
            "party its `tandem align --out` file of the same alignment (or its id column)"
        ]
    if (
        theirs is not None
        and alignment is not None
        and (
            str(theirs["commitment"]) != str(alignment["commitment"])
            or int(theirs["size"]) != int(alignment["size"])
        )
    ):
        return [
            f"the rows are aligned differently: the leader's commitment "
            f"{str(theirs['commitment'])[:12]} (size {theirs['size']}) != "
            f"that of {me}, {str(alignment['commitment'])[:12]} "
            f"(size {alignment['size']}); "
            "align the new rows again and give every party its output"
        ]
    return []


# -- running -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Predictions:
    """The leader's result: ``outputs`` (the loss stage's raw outputs, ``[rows, out]``
    float32, in row order), the ``training`` id and every party's export ``digests``."""

    outputs: np.ndarray
    training: str
    digests: dict[str, str]


def make_party(
    transport: Transport,
    model: PartyModel,
    x: np.ndarray | None,
    spec: TaskSpec,
    cut_sum: CutSum | None = None,
) -> SplitParty:
    """A forward-only `SplitParty` of ``model`` over ``x`` with the spec's runtime settings
    (``cut_sum``: the training's sum of the followers' cuts, with a follower's seeds)."""
    h = spec.hyper
    cfg = SplitConfig(
        batch_size=int(h["batch_size"]),
        groups=int(h["groups"]),
        loss=str(h.get("loss") or "binary"),
        seed=int(h["seed"]),
        threshold=int(h["threshold"]),
        capacity=int(h["capacity"]),
        policy=str(h["policy"]),
    )
    party = SplitParty(
        model.party,
        model.topology,
        model.models,
        transport,
        datasets=None if x is None else {DATASET: x},
        config=cfg,
        params=model.params,
        cut_sum=cut_sum,
    )
    party.run_id = model.training  # the commands carry the training id
    return party


async def run_leader(
    transport: Transport,
    model: PartyModel,
    x: np.ndarray | None,
    spec: TaskSpec,
    cut_sum: CutSum | None = None,
) -> Predictions:
    """Leader, after negotiation: check every follower's model description (`confirm`),
    forward ``spec.samples`` rows, tell the followers to stop."""
    followers = [p for p in model.topology.parties if p != model.party]
    digests = await confirm(transport, model, followers)
    party = await asyncio.to_thread(make_party, transport, model, x, spec, cut_sum)
    out = await party.predict(DATASET, int(spec.samples), batch_size=int(spec.hyper["batch_size"]))
    await party.stop(reason="done")
    return Predictions(out, model.training, {model.party: model.digest, **digests})


async def run_follower(
    transport: Transport,
    model: PartyModel,
    x: np.ndarray | None,
    spec: TaskSpec,
    cut_sum: CutSum | None = None,
) -> int:
    """Follower, after negotiation: describe its model to the leader, then answer its
    batches; returns batches served. `NegotiationError` if the leader refuses the model."""
    leader = model.topology.label_owner
    await transport.send(
        leader,
        negotiate.CTL,
        Frame(
            meta={
                "cmd": "model",
                "training": model.training,
                "digest": model.digest,
                "widths": model.widths,
                "cuts": model.cuts,
                "topology": model.topology.to_dict(),
            }
        ),
    )
    party = await asyncio.to_thread(make_party, transport, model, x, spec, cut_sum)
    served = await party.serve()
    if party.stop_meta.get("reason") == "refused":
        reasons = [str(r) for r in party.stop_meta.get("reasons", [])]
        raise NegotiationError(
            f"the leader refused the model of {model.party!r}:\n  " + "\n  ".join(reasons),
            {leader: reasons},
        )
    return served


async def confirm(transport: Transport, model: PartyModel, followers: list[str]) -> dict[str, str]:
    """Leader: receive each follower's model description (training id, export digest, widths,
    topology) and check it against its own export, as the followers checked the leader's;
    returns their export digests. On a mismatch every follower is stopped with the reasons and
    `NegotiationError` is raised."""
    digests, refused = {}, {}
    for peer in followers:
        meta = dict((await transport.recv(peer, negotiate.CTL)).meta)
        reasons = []
        if meta.get("cmd") != "model":
            reasons.append(
                f"{peer!r} sent {meta.get('cmd')!r} instead of its model "
                "description; is it running `tandem predict` of this version?"
            )
        else:
            if meta.get("training") != model.training:
                reasons.append(
                    f"the export of {peer!r} is of training {meta.get('training')!r}, "
                    f"the leader's of {model.training!r}"
                )
            if _plain(meta.get("topology")) != _plain(model.topology.to_dict()):
                reasons.append(f"the export of {peer!r} has another topology")
            if meta.get("widths") != model.widths:
                reasons.append(
                    f"the stage widths of {peer!r}, {meta.get('widths')}, differ "
                    f"from the leader's {model.widths}"
                )
            elif _plain(meta.get("cuts", {})) != _plain(model.cuts):
                reasons.append(
                    f"the cut shapes and dtypes of {peer!r}, {meta.get('cuts', {})}, differ "
                    f"from the leader's {model.cuts}"
                )
            digests[peer] = str(meta.get("digest"))
        if reasons:
            refused[peer] = reasons
    if refused:
        flat = [r for rs in refused.values() for r in rs]
        for peer in followers:
            await transport.send(
                peer,
                negotiate.CTL,
                Frame(meta={"cmd": "stop", "reason": "refused", "reasons": flat}),
            )
        raise NegotiationError(
            "the leader refused the followers' models:\n  " + "\n  ".join(flat), refused
        )
    return digests


async def predict(
    transport: Transport,
    model: PartyModel,
    x: np.ndarray | None = None,
    *,
    rows: int | None = None,
    alignment: Mapping[str, Any] | None = None,
    batch_size: int = 256,
    groups: int = 1,
    security: Mapping[str, Any] | None = None,
) -> Predictions:
    """Leader: negotiate with every follower, then predict; returns the `Predictions`.

    ``x``: this party's new feature rows (None if its stages read none; then give ``rows``).
    ``alignment``: ``{"size", "commitment"}`` of the new rows' alignment, if they were aligned.
    Raises `InferenceError` for bad input, `NegotiationError` with every follower's reasons.
    """
    if not model.is_leader:
        raise InferenceError(f"{model.party!r} does not own the loss stage; call serve() there")
    x, n = await asyncio.to_thread(prepare_rows, model, x, rows, alignment)
    spec = inference_spec(
        model, rows=n, batch_size=batch_size, groups=groups, alignment=alignment, security=security
    )
    followers = [p for p in model.topology.parties if p != model.party]
    await negotiate.propose(transport, followers, spec)
    return await run_leader(transport, model, x, spec)


async def serve(
    transport: Transport,
    model: PartyModel,
    x: np.ndarray | None = None,
    *,
    rows: int | None = None,
    alignment: Mapping[str, Any] | None = None,
    security: Mapping[str, Any] | None = None,
) -> int:
    """Follower: check the leader's proposal against this export and rows, then answer its
    batches; returns batches served. Raises `NegotiationError` when it refuses."""
    if model.is_leader:
        raise InferenceError(f"{model.party!r} owns the loss stage; call predict() there")
    x, n = await asyncio.to_thread(prepare_rows, model, x, rows, alignment)
    leader = model.topology.label_owner
    spec, _ = await negotiate.answer(
        transport,
        leader,
        check=inference_check(model, rows=n, alignment=alignment, security=security),
    )
    await negotiate.ready(transport, leader)
    return await run_follower(transport, model, x, spec)


def prepare_rows(
    model: PartyModel,
    x: np.ndarray | None,
    rows: int | None = None,
    alignment: Mapping[str, Any] | None = None,
) -> tuple[np.ndarray | None, int]:
    """(checked ``x``, row count): the count of ``x``, else ``rows``, else the alignment's
    size; `InferenceError` when they disagree or none is given."""
    x = check_rows(model, x)
    n = len(x) if x is not None else rows
    if n is None and alignment is not None:
        n = int(alignment["size"])
    if n is None:
        raise InferenceError(
            f"{model.party!r} holds no feature rows; give rows= (or an "
            "alignment) so the parties can check they predict the same rows"
        )
    if rows is not None and int(rows) != n:
        raise InferenceError(f"rows={rows} but the feature rows number {n}")
    if alignment is not None and int(alignment["size"]) != n:
        raise InferenceError(
            f"{model.party!r} has {n} rows but its alignment has "
            f"{alignment['size']} ids; select the rows with the aligned-ids file"
        )
    if n < 1:
        raise InferenceError("there are no rows to predict")
    return x, int(n)


def _dims(shape: list[int]) -> str:
    return ", ".join(str(d) for d in shape)


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))


__all__ = [
    "PartyModel",
    "InferenceError",
    "export_party",
    "load_model",
    "load_model_sync",
    "resolve_export",
    "check_rows",
    "prepare_rows",
    "inference_spec",
    "inference_check",
    "make_party",
    "run_leader",
    "run_follower",
    "confirm",
    "predict",
    "serve",
    "Predictions",
    "DATASET",
]
