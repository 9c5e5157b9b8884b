"""One party's trained stages, rebuilt from its own export: the loader every system's export
is read back with (split learning's `tandem predict`, a federated model, an elastic job's model).

`load_model(path, party)` reads a `tandem.parties.export` stages file (or the folder holding
``<party>.safetensors``) and returns a `PartyModel`: the party's own stages rebuilt from their
recorded model specs with their parameters, and a width-only stand-in for every other stage of
the recorded topology. Every problem (missing file, another party's or topology's export, what
inference needs missing, parameters that do not fit their spec) raises `InferenceError` naming
the file and the fix. Split learning's cross-party protocol (`tandem.parties.split.inference`)
runs on these models.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from tandem.engine.kernels import StageModel
from tandem.engine.topology import FEATURES, Topology
from tandem.errors import ConfigError
from tandem.parties.models import model_from_spec

from .stages import ExportError, load_stages


class InferenceError(ConfigError):
    """Inference cannot run with what was given (export, rows); the message says how to fix."""


@dataclasses.dataclass(frozen=True)
class PartyModel:
    """One party's trained stages, rebuilt from its own export only.

    ``models`` holds a rebuilt `StageModel` for each stage ``party`` owns, and a width-only
    stand-in for every other stage (its output width, shape and dtype, to check received
    activations; it cannot be initialised or applied). ``params`` holds the party's own stages
    only. ``data`` is the export's ``{"preprocessing", "fingerprint"}`` (None for an export
    without it). ``cuts``: the export's ``{"shape", "dtype"}`` of every stage whose output is
    not a float32 matrix (`cut_of` gives any stage's).
    """

    party: str
    topology: Topology
    params: dict[str, Any]
    models: dict[str, StageModel]
    widths: dict[str, int]
    training: str
    loss: str | None
    digest: str
    path: str
    data: dict[str, Any] | None = None  # the export's "data": preprocessing state, fingerprint
    cuts: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def cut_of(self, stage: str) -> dict[str, Any]:
        """``{"shape", "dtype"}`` of ``stage``'s output per row."""
        return self.cuts.get(stage, {"shape": [self.widths[stage]], "dtype": "float32"})

    @property
    def is_leader(self) -> bool:
        return self.topology.label_owner == self.party

    @property
    def features(self) -> int | None:
        """Feature columns this party's stages read (None when they read none)."""
        for s in self.topology.stages_of(self.party):
            for i, name in enumerate(s.inputs):
                if name == FEATURES:
                    return int(self.models[s.name].in_dims[i])
        return None


async def load_model(
    path: str | os.PathLike, party: str | None = None, *, topology: Topology | None = None
) -> PartyModel:
    """`load_model_sync` in a worker thread."""
    return await asyncio.to_thread(load_model_sync, path, party, topology=topology)


def load_model_sync(
    path: str | os.PathLike, party: str | None = None, *, topology: Topology | None = None
) -> PartyModel:
    """Read ``party``'s export at ``path`` (a file, or a folder holding ``<party>.safetensors``
    or a single ``.safetensors`` file) and rebuild its stages.

    Raises `InferenceError` naming the file and the fix when it is missing, belongs to another
    party or topology, or lacks what inference needs (model specs, widths, training id).
    """
    file = resolve_export(path, party)
    try:
        loaded = load_stages(file)
    except ExportError as exc:
        raise InferenceError(f"cannot read the export {file!r}: {exc}") from None
    desc = loaded.description
    owner = desc["party"]
    if party is not None and owner != party:
        raise InferenceError(
            f"{file!r} holds the stages of party {owner!r}, not {party!r}: each party predicts "
            f"with its own export; give {party!r} the file its training wrote"
        )
    try:
        topo = Topology.from_dict(desc["topology"])
    except Exception as exc:  # TopologyError or malformed JSON data
        raise InferenceError(f"{file!r}: the recorded topology is invalid: {exc}") from None
    if topology is not None and topology.to_dict() != topo.to_dict():
        raise InferenceError(
            f"{file!r} was trained with topology {brief_topology(topo)} but this party is "
            f"configured with {brief_topology(topology)}; fix [model] topology or pass the "
            "matching export"
        )
    lacking = [k for k in ("widths", "training") if k not in desc]
    own = [s.name for s in topo.stages_of(owner)]
    lacking += [f"stages.{s}.model" for s in own if "model" not in desc["stages"].get(s, {})]
    if lacking:
        raise InferenceError(
            f"{file!r} lacks {lacking}, which inference needs; re-export it "
            "with tandem.parties.split.inference.export_party (or `tandem party`)"
        )
    widths = {str(k): int(v) for k, v in desc["widths"].items()}
    if set(widths) != {s.name for s in topo.stages}:
        raise InferenceError(
            f"{file!r}: widths name {sorted(widths)} but the topology's stages "
            f"are {[s.name for s in topo.stages]}; re-export it"
        )
    cuts = _read_cuts(file, desc, widths)
    models: dict[str, StageModel] = {}
    for s in topo.stages:
        if s.name in own:
            try:
                models[s.name] = model_from_spec(desc["stages"][s.name]["model"])
            except ConfigError as exc:
                raise InferenceError(
                    f"{file!r}: stage {s.name!r} cannot be rebuilt from its recorded model "
                    f"{desc['stages'][s.name]['model']}: {exc}"
                ) from None
        else:
            models[s.name] = _width_only(s.name, widths[s.name], cuts.get(s.name))
    _check_params(file, {s: models[s] for s in own}, loaded.stages)
    return PartyModel(
        party=owner,
        topology=topo,
        params=dict(loaded.stages),
        models=models,
        widths=widths,
        training=str(desc["training"]),
        loss=desc.get("loss"),
        digest=str(desc["digest"]),
        path=file,
        data=desc.get("data"),
        cuts=cuts,
    )


def resolve_export(path: str | os.PathLike, party: str | None) -> str:
    """The stages file meant by ``path`` (see `load_model_sync`)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        named = os.path.join(path, f"{party}.safetensors") if party else None
        if named and os.path.isfile(named):
            return named
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if len(found) == 1:
            return os.path.join(path, found[0])
        raise InferenceError(
            f"export folder {path!r} holds {len(found)} .safetensors files "
            f"{found}; pass the file of this party"
            + (f" (or name it {party}.safetensors)" if party else "")
        )
    if not os.path.isfile(path):
        raise InferenceError(
            f"no export at {path!r}; pass the .safetensors file (or the "
            "export_dir folder) this party's training wrote"
        )
    return path


def _read_cuts(
    file: str, desc: Mapping[str, Any], widths: Mapping[str, int]
) -> dict[str, dict[str, Any]]:
    """The export's ``cuts``, checked against its widths (`InferenceError` naming the stage)."""
    cuts = desc.get("cuts", {})
    out = {}
    for name, cut in cuts.items() if isinstance(cuts, Mapping) else [("?", cuts)]:
        try:
            shape, dtype = [int(d) for d in cut["shape"]], str(cut["dtype"])
            _width_only(name, widths[name], {"shape": shape, "dtype": dtype})
        except (ConfigError, KeyError, TypeError, ValueError):
            raise InferenceError(
                f"{file!r}: cuts.{name} {cut!r} does not describe an output of the recorded "
                f"width {widths.get(name)} (shape after the rows and a cut dtype); re-export it"
            ) from None
        out[str(name)] = {"shape": shape, "dtype": dtype}
    return out


def _width_only(stage: str, width: int, cut: Mapping[str, Any] | None = None) -> StageModel:
    def unavailable(*_: Any) -> Any:
        raise InferenceError(f"stage {stage!r} belongs to another party; it has no parameters here")

    if cut is None:
        return StageModel(unavailable, unavailable, (), int(width))
    return StageModel(
        unavailable,
        unavailable,
        (),
        int(width),
        out_shape=tuple(cut["shape"]),
        out_dtype=str(cut["dtype"]),
    )


def _check_params(file: str, models: Mapping[str, StageModel], params: Mapping[str, Any]) -> None:
    import jax

    for name, model in models.items():
        want = jax.eval_shape(model.init, jax.random.PRNGKey(0))
        structure: Any = jax.tree_util.tree_structure(want)
        ok = bool(structure == jax.tree_util.tree_structure(params[name]))
        ok = ok and all(
            tuple(a.shape) == tuple(np.shape(b))
            for a, b in zip(
                jax.tree_util.tree_leaves(want),
                jax.tree_util.tree_leaves(params[name]),
                strict=True,
            )
        )
        if not ok:
            raise InferenceError(
                f"{file!r}: the parameters of stage {name!r} do not fit its "
                "recorded model spec; the file is inconsistent, re-export it"
            )


def brief_topology(topology: Topology | Mapping[str, Any]) -> str:
    """``[stage@owner, ...]``: a topology in one line, for error messages."""
    try:
        d = topology.to_dict() if isinstance(topology, Topology) else topology
        return "[" + ", ".join(f"{s['name']}@{s['owner']}" for s in d["stages"]) + "]"
    except (KeyError, TypeError):
        return repr(topology)[:80]


__all__ = [
    "InferenceError",
    "PartyModel",
    "brief_topology",
    "load_model",
    "load_model_sync",
    "resolve_export",
]
