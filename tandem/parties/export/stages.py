"""Save and load one party's trained stages: safetensors plus a JSON description. No pickle.

The one export format of all three systems: split learning writes each party's stages with it
(`tandem.parties.split.inference.export_party`), federated learning its global model
(`tandem.parties.fl.export`), elastic training its model (`tandem.parties.elastic.party_data`);
`tandem predict` reads any of them.

File format (one ``.safetensors`` file per party, see docs/alignment.md#export):

* tensors: every array leaf of every stage, named ``"<stage>/<path>"`` where path joins the
  pytree keys/indices with ``/`` (e.g. ``"bottom/0/w"``); stored little-endian exactly as
  given (``bfloat16`` is stored as its ``uint16`` bit pattern, the description keeps the real
  dtype);
* header metadata key ``"tandem"``: the description, a JSON object::

    {"format": "tandem-stages", "version": 1, "party": "A",
     "topology": {...},                          # as given by the caller (JSON data)
     "stages": {"bottom": {"sizes": [8, 16, 4],  # MLP layer sizes, or null for other pytrees
                           "dtype": "float32",   # dtype of the stage's leaves ("mixed" if several)
                           "structure": [{"w": "bottom/0/w", "b": "bottom/0/b"}, ...],
                           "tensors": {"bottom/0/w": {"dtype": "float32", "shape": [8, 16]}, ...}}},
     "digest": "<sha256 over names, dtypes, shapes and bytes of all tensors, in name order>"}

Optional fields (written only when the caller gives them; files without them stay valid, and
their digest is unchanged), which cross-party inference (`tandem.parties.split.inference`) needs to
rebuild a party from its own file alone:

* ``stages[name]["model"]``: the stage's `tandem.engine.kernels.StageModel.spec`, e.g.
  ``{"kind": "mlp", "in_dims": [8], "hidden": [32], "out_dim": 16, "activate_last": true}``;
* ``"widths"``: output width of *every* stage of the topology, the other parties' included
  (the cut-layer widths, to check received tensors), e.g. ``{"bottom": 16, "top": 1}``;
* ``"cuts"``: for each stage whose output is not a float32 matrix, its shape after the rows
  and dtype, e.g. ``{"bottom": {"shape": [4, 4], "dtype": "bfloat16"}}`` (every other stage
  outputs ``float32[rows, width]``);
* ``"training"``: an id shared by every party's export of one training run;
* ``"loss"``: the loss the loss stage was trained with (``"binary"``, ``"softmax"``, ``"mse"``);
* ``"data"``: what the party's features came from: ``{"preprocessing": <the JSON state of
  `tandem.parties.data.Preprocessing.to_json`, or null for pre-split arrays>,
  "fingerprint": <the training data's fingerprint>}``; prediction applies that state.

The digest also covers these fields when present.

``structure`` mirrors the pytree: JSON objects for dicts (str keys), arrays for lists,
``{"tuple": [...]}`` for tuples, and tensor names at the leaves.

Contract: ``load_stages(save_stages(...))`` returns arrays bit-identical to those saved, with
the same pytree structure; a file whose description, digest or tensors disagree with each
other or with what the caller expects raises `ExportError`/`ExportMismatchError` naming the
field. Loading never executes code from the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import safetensors.numpy
from safetensors import safe_open

from tandem.engine.topology import CUT_DTYPES
from tandem.errors import EngineError
from tandem.parties.files import write_atomic

FORMAT = "tandem-stages"
VERSION = 1
_META_KEY = "tandem"
#: Optional top-level description fields (see the module docstring), covered by the digest.
OPTIONAL_FIELDS = ("widths", "cuts", "training", "loss", "data")


class ExportError(EngineError):
    """A stages file could not be written or read (bad pytree, unsupported dtype, corrupt or
    foreign file); the message names the stage/tensor and the fix."""


class ExportMismatchError(ExportError):
    """A stages file is valid but describes something other than what the caller expects."""


@dataclasses.dataclass(frozen=True)
class LoadedStages:
    """``stages``: stage name -> params pytree of numpy arrays; ``description``: the JSON."""

    stages: dict[str, Any]
    description: dict[str, Any]


def describe(
    stages: Mapping[str, Any], *, topology: Mapping[str, Any], party: str, **optional: Any
) -> dict:
    """The description `save_stages` writes for these stages (without the digest)."""
    _, desc = _flatten_all(stages, topology=topology, party=party, **optional)
    return desc


def save_stages(
    path: str | os.PathLike,
    stages: Mapping[str, Any],
    *,
    topology: Mapping[str, Any],
    party: str,
    models: Mapping[str, Mapping[str, Any]] | None = None,
    widths: Mapping[str, int] | None = None,
    training: str | None = None,
    loss: str | None = None,
    data: Mapping[str, Any] | None = None,
    cuts: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Write ``stages`` (name -> params pytree of arrays) and their description to ``path``.

    ``models`` (stage -> model spec), ``widths``, ``cuts``, ``training``, ``loss`` and ``data``
    are the optional fields of the module docstring; each is written only when given.

    The file is written to a temporary name and renamed, so a crash never leaves a partial
    file under ``path``. Returns the description written (including the digest).
    """
    tensors, desc = _flatten_all(
        stages,
        topology=topology,
        party=party,
        models=models,
        widths=widths,
        training=training,
        loss=loss,
        data=data,
        cuts=cuts,
    )
    desc["digest"] = _digest(tensors, desc)
    stored = {name: _storable(arr) for name, arr in tensors.items()}
    blob = safetensors.numpy.save(stored, metadata={_META_KEY: json.dumps(desc, sort_keys=True)})
    write_atomic(path, blob)
    return desc


def read_description(path: str | os.PathLike) -> dict[str, Any]:
    """The description stored in ``path`` (tensors are not read)."""
    try:
        with safe_open(os.fspath(path), framework="np") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own SafetensorError
        if isinstance(exc, FileNotFoundError):
            raise ExportError(f"no stages file at {os.fspath(path)!r}") from None
        raise ExportError(f"{os.fspath(path)!r} is not a safetensors file: {exc}") from None
    if _META_KEY not in meta:
        raise ExportError(
            f"{os.fspath(path)!r} has no {_META_KEY!r} description: it was not written by "
            "tandem.parties.export.save_stages"
        )
    try:
        desc = json.loads(meta[_META_KEY])
    except json.JSONDecodeError as exc:
        raise ExportError(f"description in {os.fspath(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(desc, dict) or desc.get("format") != FORMAT:
        raise ExportError(f"{os.fspath(path)!r} is not a {FORMAT!r} file")
    if desc.get("version") != VERSION:
        raise ExportError(
            f"{os.fspath(path)!r} has format version {desc.get('version')!r}; this Tandem reads "
            f"version {VERSION}: re-export it with a matching Tandem"
        )
    return desc


def load_stages(
    path: str | os.PathLike,
    *,
    expect: Mapping[str, Any] | None = None,
    stages: tuple[str, ...] | None = None,
) -> LoadedStages:
    """Load the stages saved in ``path``, bit-exactly, after checking the file.

    Args:
      expect: fields the description must match, e.g. ``{"party": "A", "topology": topo,
        "stages": {"bottom": {"sizes": [8, 16, 4], "dtype": "float32"}}}`` (only the fields
        given are compared; `describe` builds a full one). A difference raises
        `ExportMismatchError` naming the field, the expected and the stored value.
      stages: load only these stage names (all by default).
    """
    desc = read_description(path)
    if expect:
        try:
            expect = json.loads(json.dumps(expect))
        except (TypeError, ValueError) as exc:
            raise ExportError(f"expect must be JSON data: {exc}") from None
        if "topology" in expect and expect["topology"] != desc["topology"]:
            raise ExportMismatchError(
                f"the topology in {os.fspath(path)!r} differs from the expected one: expected "
                f"{expect['topology']!r}, the file has {desc['topology']!r}; load the file "
                "exported for this topology, or re-export it"
            )
        _compare(expect, desc, "description")
    names = tuple(desc["stages"]) if stages is None else stages
    for name in names:
        if name not in desc["stages"]:
            raise ExportMismatchError(
                f"stage {name!r} is not in {os.fspath(path)!r}; it holds {sorted(desc['stages'])}"
            )
    tensors: dict[str, np.ndarray] = {}
    with safe_open(os.fspath(path), framework="np") as f:
        stored_names = set(f.keys())
        for st in desc["stages"].values():
            for tname, spec in st["tensors"].items():
                if tname not in stored_names:
                    raise ExportError(f"tensor {tname!r} described but missing from the file")
                tensors[tname] = _restore(f.get_tensor(tname), spec, tname)
    if _digest(tensors, desc) != desc.get("digest"):
        raise ExportError(
            f"digest of the tensors in {os.fspath(path)!r} does not match its description: "
            "the file is corrupt or was edited; re-export it"
        )
    out = {name: _unflatten(desc["stages"][name]["structure"], tensors) for name in names}
    return LoadedStages(stages=out, description=desc)


# -- internals -------------------------------------------------------------------------------


def _flatten_all(
    stages: Mapping[str, Any],
    *,
    topology: Mapping[str, Any],
    party: str,
    models: Mapping[str, Mapping[str, Any]] | None = None,
    widths: Mapping[str, int] | None = None,
    training: str | None = None,
    loss: str | None = None,
    data: Mapping[str, Any] | None = None,
    cuts: Mapping[str, Mapping[str, Any]] | None = None,
):
    if not isinstance(party, str) or not party:
        raise ExportError(f"party must be a non-empty string, got {party!r}")
    try:
        topo = json.loads(json.dumps(topology, sort_keys=True))
    except (TypeError, ValueError) as exc:
        raise ExportError(
            f"topology must be JSON data (dicts, lists, str, numbers): {exc}"
        ) from None
    tensors, described = _flatten_stages(stages)
    _add_models(described, models)
    desc = {
        "format": FORMAT,
        "version": VERSION,
        "party": party,
        "topology": topo,
        "stages": described,
    }
    desc.update(_optional_fields(widths, training, loss, data, cuts))
    return tensors, desc


def _flatten_stages(
    stages: Mapping[str, Any],
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
    """Every stage's arrays by tensor name, and each stage's description (sizes, dtype,
    structure, tensors)."""
    tensors: dict[str, np.ndarray] = {}
    described = {}
    for name, params in stages.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ExportError(f"stage name must be a non-empty string without '/', got {name!r}")
        leaves: dict[str, np.ndarray] = {}
        structure = _flatten(params, name, leaves)
        if not leaves:
            raise ExportError(f"stage {name!r} has no arrays to save")
        dtypes = {a.dtype.name for a in leaves.values()}
        described[name] = {
            "sizes": _mlp_sizes(params),
            "dtype": dtypes.pop() if len(dtypes) == 1 else "mixed",
            "structure": structure,
            "tensors": {
                t: {"dtype": a.dtype.name, "shape": list(a.shape)} for t, a in leaves.items()
            },
        }
        tensors.update(leaves)
    return tensors, described


def _add_models(
    described: dict[str, dict[str, Any]], models: Mapping[str, Mapping[str, Any]] | None
) -> None:
    """Record each saved stage's model spec (JSON data) in its description."""
    for name, spec in (models or {}).items():
        if name not in described:
            raise ExportError(
                f"models has a spec for stage {name!r}, which is not among the "
                f"stages being saved {sorted(described)}"
            )
        try:
            described[name]["model"] = json.loads(json.dumps(spec, sort_keys=True))
        except (TypeError, ValueError) as exc:
            raise ExportError(f"model spec of stage {name!r} must be JSON data: {exc}") from None


def _optional_fields(
    widths: Mapping[str, int] | None,
    training: str | None,
    loss: str | None,
    data: Mapping[str, Any] | None,
    cuts: Mapping[str, Mapping[str, Any]] | None,
) -> dict[str, Any]:
    """The description's optional fields, checked, in the order they are recorded."""
    desc: dict[str, Any] = {}
    if widths is not None:
        if not isinstance(widths, Mapping) or not all(
            isinstance(k, str)
            and isinstance(v, (int, np.integer))
            and not isinstance(v, bool)
            and v >= 1
            for k, v in widths.items()
        ):
            raise ExportError(f"widths must map stage names to positive ints, got {widths!r}")
        desc["widths"] = {k: int(v) for k, v in sorted(widths.items())}
    if cuts is not None:
        desc["cuts"] = {str(k): _cut(k, v) for k, v in sorted(cuts.items())}
    if training is not None:
        if not isinstance(training, str) or not training:
            raise ExportError(f"training must be a non-empty string id, got {training!r}")
        desc["training"] = training
    if loss is not None:
        if not isinstance(loss, str) or not loss:
            raise ExportError(f"loss must be a loss name such as 'binary', got {loss!r}")
        desc["loss"] = loss
    if data is not None:
        try:
            desc["data"] = json.loads(json.dumps(dict(data), sort_keys=True))
        except (TypeError, ValueError) as exc:
            raise ExportError(f"data must be JSON data: {exc}") from None
    return desc


def _cut(stage: Any, cut: Any) -> dict[str, Any]:
    """A ``cuts`` entry as JSON data, after checking it; `ExportError` naming the stage."""
    ok = (
        isinstance(stage, str)
        and isinstance(cut, Mapping)
        and set(cut) == {"shape", "dtype"}
        and cut["dtype"] in CUT_DTYPES
        and isinstance(cut["shape"], (list, tuple))
        and len(cut["shape"]) >= 1
        and all(
            isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 1
            for d in cut["shape"]
        )
    )
    if not ok:
        raise ExportError(
            f"cuts[{stage!r}] must be {{'shape': [positive sizes after the rows], 'dtype': one "
            f"of {list(CUT_DTYPES)}}}, got {cut!r}"
        )
    return {"shape": [int(d) for d in cut["shape"]], "dtype": str(cut["dtype"])}


def _flatten(node: Any, prefix: str, out: dict[str, np.ndarray]) -> Any:
    if isinstance(node, Mapping):
        result = {}
        for k, v in node.items():
            if not isinstance(k, str) or not k or "/" in k:
                raise ExportError(
                    f"pytree key {k!r} under {prefix!r} must be a non-empty str without '/'"
                )
            result[k] = _flatten(v, f"{prefix}/{k}", out)
        return result
    if isinstance(node, list):
        return [_flatten(v, f"{prefix}/{i}", out) for i, v in enumerate(node)]
    if isinstance(node, tuple):
        return {"tuple": [_flatten(v, f"{prefix}/{i}", out) for i, v in enumerate(node)]}
    arr = np.asarray(node)
    if arr.dtype.kind not in "biufc" and arr.dtype.name != "bfloat16":
        raise ExportError(
            f"leaf {prefix!r} has dtype {arr.dtype}; only numeric arrays can be saved"
        )
    out[prefix] = np.ascontiguousarray(arr).reshape(arr.shape)  # (0-d stays 0-d)
    return prefix


def _unflatten(structure: Any, tensors: Mapping[str, np.ndarray]) -> Any:
    if isinstance(structure, str):
        return tensors[structure]
    if isinstance(structure, list):
        return [_unflatten(s, tensors) for s in structure]
    if (
        isinstance(structure, dict)
        and set(structure) == {"tuple"}
        and isinstance(structure["tuple"], list)
    ):
        return tuple(_unflatten(s, tensors) for s in structure["tuple"])
    if isinstance(structure, dict):
        return {k: _unflatten(v, tensors) for k, v in structure.items()}
    raise ExportError(f"malformed structure entry {structure!r} in the description")


def _mlp_sizes(params: Any) -> list[int] | None:
    """Layer sizes when ``params`` is an `tandem.engine.models.mlp_init` pytree, else None."""
    if not isinstance(params, list) or not params:
        return None
    sizes: list[int] = []
    for layer in params:
        if not isinstance(layer, Mapping) or set(layer) != {"w", "b"}:
            return None
        w, b = np.shape(layer["w"]), np.shape(layer["b"])
        if len(w) != 2 or b != (w[1],) or (sizes and sizes[-1] != w[0]):
            return None
        sizes = sizes or [int(w[0])]
        sizes.append(int(w[1]))
    return sizes


def _storable(arr: np.ndarray) -> np.ndarray:
    return (
        arr.view(np.uint16)
        if arr.dtype.name == "bfloat16"
        else arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    )


def _restore(arr: np.ndarray, spec: Mapping[str, Any], name: str) -> np.ndarray:
    if spec["dtype"] == "bfloat16":
        import ml_dtypes  # shipped with JAX

        arr = arr.view(ml_dtypes.bfloat16)
    if arr.dtype.name != spec["dtype"] or list(arr.shape) != list(spec["shape"]):
        raise ExportError(
            f"tensor {name!r} is stored as {arr.dtype.name} {list(arr.shape)} but described as "
            f"{spec['dtype']} {spec['shape']}: the file is corrupt; re-export it"
        )
    return arr


def _digest(tensors: Mapping[str, np.ndarray], desc: Mapping[str, Any]) -> str:
    h = hashlib.sha256(FORMAT.encode())
    h.update(
        json.dumps(
            {k: desc[k] for k in ("party", "topology", "stages", *OPTIONAL_FIELDS) if k in desc},
            sort_keys=True,
        ).encode()
    )
    for name in sorted(tensors):
        arr = tensors[name]
        h.update(f"{name}|{arr.dtype.name}|{list(arr.shape)}|".encode())
        h.update(_storable(arr).tobytes())
    return h.hexdigest()


def _compare(expected: Any, actual: Any, where: str) -> None:
    if isinstance(expected, Mapping) and isinstance(actual, Mapping):
        for k, v in expected.items():
            if k not in actual:
                raise ExportMismatchError(f"{where}.{k} is expected but the file has no such field")
            _compare(v, actual[k], f"{where}.{k}")
        return
    if expected != actual:
        raise ExportMismatchError(
            f"{where} does not match: expected {expected!r}, the file has {actual!r}; load the "
            "file exported for this party and topology, or re-export it"
        )
