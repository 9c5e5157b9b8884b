"""`TaskSpec`: what the parties of a split-learning job agree on before training. Pure data.

The leader builds a spec from its configuration (`build_spec`) and proposes it; each follower
checks it against what it holds (`TaskSpec.check_local`) and accepts or refuses with reasons
(`tandem.parties.split.negotiate`). Both sides then stamp every frame with `TaskSpec.spec_hash` and
refuse tensors whose dtype or shape differs from `TaskSpec.channel_shapes`.

Fields (all JSON data, see docs/parties.md#task-spec):

* ``topology``: `tandem.engine.topology.Topology.to_dict`;
* ``datasets``: party -> ``{"features": int, "dtype": "float32"}`` for every party whose stages
  read raw features;
* ``samples``: rows of the (aligned) training set, identical on every party;
* ``stages``: stage -> ``{"owner", "in_dims", "out_dim", "sizes"}`` (``sizes``: MLP layer sizes
  or null), plus ``"out_shape"`` (the output's shape after the rows, recorded when it is not
  ``[out_dim]``) and ``"out_dtype"`` (recorded when not ``"float32"``);
* ``edges``: one entry per cut edge ``{"src", "dst", "src_party", "dst_party", "width",
  "dtype"}`` (+ ``"shape"`` when the source's ``out_shape`` is recorded): activations on
  ``act/src->dst`` and gradients on ``grad/src->dst`` are ``dtype[rows, *shape]`` (``shape``
  defaults to ``[width]``) with ``1 <= rows <= max_rows``;
* ``hyper``: batch size, eval batch size, groups policy, learning rate, optimizer, loss, epochs,
  seed, threshold, capacity, policy, checkpoint_every; optionally ``chunks`` (messages per
  group, recorded when not 1), ``test_samples`` and ``validation_samples`` (rows of the test
  and validation splits every party must hold when the leader evaluates; the latter recorded
  when not 0), ``split`` (``{"test", "validation", "seed"}`` of the parties' ``[data.split]``,
  recorded for table sources) and ``fingerprints`` (party -> the fingerprint of its training
  data and preprocessing, recorded when known), ``compress`` and, for ``"topk"``,
  ``compress_topk`` (cut-layer compression, `tandem.parties.split.compress`; recorded when not
  ``"none"``: act and grad messages then carry that compressor's layout of the tensor),
  ``privacy`` (the ``[privacy]`` seed and defense tables,
  `tandem.parties.privacy.config.Privacy.spec_fields`; recorded when a defense is on or the
  seed is not 0: every party trains with these defenses);
  ``aggregate`` and, for ``"secure_sum"``, ``sum_ring`` (``{"bits", "frac", "bound"}``; the
  loss stage reads the sum of its cuts, `tandem.parties.privacy.securesum`; recorded when not
  ``"concat"``: a secure sum's act messages are then ``uint<bits>[rows, width]`` ring words);
* ``security``: ``{"auth": "hmac"|"none", "tls": bool, "max_frame_bytes": int,
  "reject_nonfinite": bool}``;
* ``alignment``: ``{"size", "commitment"}`` from `tandem.parties.alignment.AlignedIds`, or null.

Canonical form: orjson with sorted keys (`TaskSpec.canonical`); `spec_hash` is its SHA-256 hex.
Equal specs give equal bytes and hashes on every machine; a spec read back with `from_json`
hashes to the same value.

Contract: no JAX, no asyncio; `check_local` never raises for a mismatch, it returns every reason
as a readable sentence (an empty list means "accept").
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from tandem.engine.topology import CUT_DTYPES, FEATURES, Topology
from tandem.errors import ConfigError

from ..privacy.config import mismatch_reasons as privacy_mismatch
from ..privacy.config import privacy_from
from ..privacy.securesum import ring_channels
from ..privacy.securesum import spec_fields as sum_spec_fields
from .compress import from_hyper
from .hyper import HYPER_KEYS, SPEC_DEFAULTS

SPEC_FORMAT = "tandem-task-spec"
#: 2: every field `tandem.parties.split.hyper` marks for the spec is recorded, with its
#: declared default when not given (version 1 left out chunks = 1 and compress = "none").
SPEC_VERSION = 2

SECURITY_KEYS = ("auth", "tls", "max_frame_bytes", "reject_nonfinite")


class SpecError(ConfigError):
    """A task spec is malformed (missing field, wrong type, foreign format)."""


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """The agreed task of one split-learning job. See the module docstring for the fields."""

    topology: Mapping[str, Any]
    datasets: Mapping[str, Mapping[str, Any]]
    samples: int
    stages: Mapping[str, Mapping[str, Any]]
    edges: Sequence[Mapping[str, Any]]
    hyper: Mapping[str, Any]
    security: Mapping[str, Any]
    alignment: Mapping[str, Any] | None = None

    # -- canonical form --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": SPEC_FORMAT,
            "version": SPEC_VERSION,
            "topology": _plain(self.topology),
            "datasets": _plain(self.datasets),
            "samples": int(self.samples),
            "stages": _plain(self.stages),
            "edges": _plain(list(self.edges)),
            "hyper": _plain(self.hyper),
            "security": _plain(self.security),
            "alignment": None if self.alignment is None else _plain(self.alignment),
        }

    def canonical(self) -> bytes:
        """orjson bytes with sorted keys: the input of `spec_hash`."""
        return orjson.dumps(self.to_dict(), option=orjson.OPT_SORT_KEYS)

    def spec_hash(self) -> str:
        """SHA-256 hex of `canonical`; stamped on every frame after negotiation."""
        return hashlib.sha256(self.canonical()).hexdigest()

    @classmethod
    def from_dict(cls, data: object) -> TaskSpec:
        """Read a spec back (e.g. from a proposal frame, so any JSON value); `SpecError` names
        a bad field."""
        if not isinstance(data, Mapping):
            raise SpecError(f"a task spec must be a JSON object, got {type(data).__name__}")
        if data.get("format") != SPEC_FORMAT or data.get("version") != SPEC_VERSION:
            raise SpecError(
                f"not a {SPEC_FORMAT!r} version {SPEC_VERSION} spec (format "
                f"{data.get('format')!r}, version {data.get('version')!r}); "
                "both parties must run compatible Tandem versions"
            )
        kinds = {
            "topology": Mapping,
            "datasets": Mapping,
            "samples": int,
            "stages": Mapping,
            "edges": list,
            "hyper": Mapping,
            "security": Mapping,
        }
        for key, kind in kinds.items():
            if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
                raise SpecError(
                    f"task spec field {key!r} must be {kind.__name__}, got {data.get(key)!r:.80}"
                )
        missing = [k for k in HYPER_KEYS if k not in data["hyper"]]
        missing += [k for k in SECURITY_KEYS if k not in data["security"]]
        if missing:
            raise SpecError(f"task spec lacks fields {missing}")
        try:
            privacy_from(data["hyper"].get("privacy"))
        except ValueError as exc:
            raise SpecError(f"task spec field hyper.privacy is malformed: {exc}") from None
        align = data.get("alignment")
        if align is not None and (
            not isinstance(align, Mapping) or set(align) != {"size", "commitment"}
        ):
            raise SpecError(
                f"task spec alignment must be null or {{size, commitment}}, got {align!r:.80}"
            )
        return cls(
            topology=data["topology"],
            datasets=data["datasets"],
            samples=data["samples"],
            stages=data["stages"],
            edges=data["edges"],
            hyper=data["hyper"],
            security=data["security"],
            alignment=align,
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> TaskSpec:
        try:
            return cls.from_dict(orjson.loads(raw))
        except orjson.JSONDecodeError as exc:
            raise SpecError(f"task spec is not valid JSON: {exc}") from None

    # -- derived ---------------------------------------------------------------------------
    @property
    def max_rows(self) -> int:
        """Most rows any batch (train or eval) may carry."""
        return max(int(self.hyper["batch_size"]), int(self.hyper["eval_batch_size"]))

    def channel_shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``{channel: (dtype, shape after the rows)}`` for every activation and gradient
        channel."""
        out = {}
        for e in self.edges:
            shape = tuple(int(d) for d in e.get("shape", [e["width"]]))
            for kind in ("act", "grad"):
                out[f"{kind}/{e['src']}->{e['dst']}"] = (str(e["dtype"]), shape)
        if "aggregate" in self.hyper:  # a secure sum's cuts travel as flat ring words
            topo = Topology.from_dict(self.topology)
            for ch, dtype in ring_channels(self.hyper, topo).items():
                out[ch] = (dtype, (math.prod(out[ch][1]),))
        return out

    # -- checks ----------------------------------------------------------------------------
    def check_local(
        self,
        party: str,
        *,
        features: int | None,
        samples: int | None,
        dtype: str = "float32",
        stages: Mapping[str, Mapping[str, Any]] | None = None,
        alignment: Mapping[str, Any] | None = None,
        security: Mapping[str, Any] | None = None,
        topology: Mapping[str, Any] | None = None,
        privacy: Mapping[str, Any] | None = None,
    ) -> list[str]:
        """Reasons why ``party`` cannot train this spec with what it holds ([] = accept).

        Args:
          features: columns of the party's feature matrix (None if it holds none).
          samples: rows of its training set (after alignment); None if it holds no data.
          stages: its own view of stage widths (``{"in_dims", "out_dim", "sizes"}`` per stage,
            optionally ``"out_shape"`` and ``"out_dtype"``), compared for the stages it owns and
            every stage feeding or fed by them.
          alignment: its `AlignedIds.spec_fields`-like ``{"size", "commitment"}``, or None.
          security: its own security settings; the keys given must equal the spec's.
          topology: its own topology (`Topology.to_dict`), if it has one configured.
          privacy: the ``[privacy]`` keys it states (`Privacy.stated`); each must equal the
            leader's (``privacy.KEY: leader says X, this party says Y`` otherwise).
        """
        who = f"{party!r}"
        try:
            topo = Topology.from_dict(self.topology)
        except Exception as exc:  # TopologyError: the proposal itself is broken
            return [f"the spec's topology is invalid: {exc}"]
        if party not in topo.parties:
            return [f"{who} owns no stage of the spec's topology (parties: {list(topo.parties)})"]
        reasons: list[str] = []
        if topology is not None and _plain(topology) != _plain(self.topology):
            reasons.append(
                f"{who}'s configured topology differs from the spec's: local "
                f"{_brief(topology)} != spec {_brief(self.topology)}"
            )
        reasons += self._data_reasons(party, topo, features, dtype)
        if samples is not None and int(samples) != int(self.samples):
            reasons.append(f"{who}: sample count {samples} != spec {self.samples}")
        reasons += self._stage_reasons(party, topo, stages)
        reasons += self._alignment_reasons(who, alignment)
        for key, value in (security or {}).items():
            if key in self.security and _plain(self.security[key]) != _plain(value):
                reasons.append(
                    f"security setting {key!r}: {who} uses {value!r} but the spec "
                    f"says {self.security[key]!r}"
                )
        reasons += privacy_mismatch(self.hyper.get("privacy"), privacy or {})
        return reasons

    def _data_reasons(
        self, party: str, topo: Topology, features: int | None, dtype: str
    ) -> list[str]:
        """`check_local`: the party's feature columns and dtype against its dataset schema."""
        who = f"{party!r}"
        if not any(FEATURES in s.inputs for s in topo.stages_of(party)):
            return []
        schema = self.datasets.get(party)
        if schema is None:
            return [f"the spec gives no dataset schema for {who}, whose stages read features"]
        if features is None:
            return [
                f"{who} holds no feature data but the spec says "
                f"{schema.get('features')} feature columns"
            ]
        reasons = []
        if int(schema.get("features", -1)) != int(features):
            reasons.append(
                f"{who} has {features} feature columns but the spec says {schema.get('features')}"
            )
        if str(schema.get("dtype")) != dtype:
            reasons.append(f"{who}'s features are {dtype} but the spec says {schema.get('dtype')}")
        return reasons

    def _stage_reasons(
        self, party: str, topo: Topology, stages: Mapping[str, Mapping[str, Any]] | None
    ) -> list[str]:
        """`check_local`: the widths, shapes and dtypes of the party's stages and of every
        stage feeding or fed by them."""
        who = f"{party!r}"
        mine = {s.name for s in topo.stages_of(party)}
        near = set(mine)
        for s in topo.stages:
            if s.name in mine:
                near.update(i for i in s.inputs if i != FEATURES)
            if mine & set(s.inputs):
                near.add(s.name)
        reasons = []
        for name in sorted(near):
            if name not in self.stages:
                reasons.append(f"the spec describes no widths for stage {name!r}")
                continue
            if stages is None or name not in stages:
                continue
            spec_st, local = self.stages[name], stages[name]
            for key in ("in_dims", "out_dim", "sizes"):
                if key in local and _plain(local[key]) != _plain(spec_st.get(key)):
                    reasons.append(
                        f"stage {name!r}: {who} has {key} {_plain(local[key])} but "
                        f"the spec says {_plain(spec_st.get(key))}"
                    )
            for key, theirs in zip(("out_shape", "out_dtype"), cut_of(spec_st), strict=True):
                if key in local and _plain(local[key]) != theirs:
                    reasons.append(
                        f"stage {name!r}: {who} has {key} {_plain(local[key])} but the spec "
                        f"says {theirs}; the cut tensor must have the same shape and dtype on "
                        "both sides"
                    )
        return reasons

    def _alignment_reasons(self, who: str, alignment: Mapping[str, Any] | None) -> list[str]:
        """`check_local`: the party's alignment commitment against the spec's."""
        if self.alignment is not None and alignment is None:
            return [
                f"the spec records aligned rows (size {self.alignment['size']}) "
                f"but {who} has no alignment; run `tandem align` and set "
                "data.aligned"
            ]
        if self.alignment is None and alignment is not None:
            return [
                f"{who} aligned its rows (size {alignment['size']}) but the spec "
                "records no alignment"
            ]
        if (
            self.alignment is not None
            and alignment is not None
            and (
                int(alignment["size"]) != int(self.alignment["size"])
                or alignment["commitment"] != self.alignment["commitment"]
            )
        ):
            return [
                f"aligned rows differ: spec commitment {_short(self.alignment['commitment'])}"
                f" (size {self.alignment['size']}) != local "
                f"{_short(alignment['commitment'])} (size {alignment['size']}); the parties "
                "hold different ids: run `tandem align` on every party and set data.aligned"
            ]
        return []


def build_spec(
    topology: Topology,
    *,
    features: Mapping[str, int],
    samples: int,
    stage_widths: Mapping[str, Mapping[str, Any]],
    hyper: Mapping[str, Any],
    security: Mapping[str, Any],
    alignment: Mapping[str, Any] | None = None,
    dtype: str = "float32",
    test_samples: int | None = None,
    validation_samples: int = 0,
    split: Mapping[str, Any] | None = None,
    fingerprints: Mapping[str, str] | None = None,
) -> TaskSpec:
    """Assemble a spec; cut-edge shapes are derived from the topology and the stage widths.

    Args:
      features: feature columns of every party whose stages read features.
      stage_widths: stage -> ``{"in_dims": [...], "out_dim": int, "sizes": [...] | None}``
        for every stage of ``topology``, optionally with ``"out_shape"`` (shape after the
        rows, ``prod == out_dim``) and ``"out_dtype"`` (a cut dtype) of its output.
      test_samples: rows of the test split the leader will evaluate on (recorded as
        ``hyper["test_samples"]`` only when given).
      validation_samples, split, fingerprints: recorded in ``hyper`` when not 0 / None.
    Raises `SpecError` naming what is missing or inconsistent.
    """
    missing = [k for k in HYPER_KEYS if k not in hyper]
    missing += [f"security.{k}" for k in SECURITY_KEYS if k not in security]
    if missing:
        raise SpecError(f"cannot build a task spec without {missing}")
    stages = _spec_stages(topology, stage_widths)
    _check_inputs(topology, features, stages)
    edges = spec_edges(topology, stages, dtype)
    return TaskSpec(
        topology=topology.to_dict(),
        datasets={
            p: {"features": int(features[p]), "dtype": dtype} for p in topology.feature_parties()
        },
        samples=int(samples),
        stages=stages,
        edges=edges,
        hyper={
            **{k: hyper[k] for k in HYPER_KEYS},
            **{k: hyper.get(k, default) for k, default in SPEC_DEFAULTS.items()},
            **({} if test_samples is None else {"test_samples": int(test_samples)}),
            **from_hyper(hyper).spec_fields(),
            **privacy_from(hyper.get("privacy")).spec_fields(),
            **sum_spec_fields(hyper),
            **({"validation_samples": int(validation_samples)} if validation_samples else {}),
            **({} if split is None else {"split": dict(split)}),
            **({} if not fingerprints else {"fingerprints": dict(fingerprints)}),
        },
        security={k: security[k] for k in SECURITY_KEYS},
        alignment=None
        if alignment is None
        else {"size": int(alignment["size"]), "commitment": str(alignment["commitment"])},
    )


def _spec_stages(
    topology: Topology, stage_widths: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """`build_spec`: each stage's spec entry (owner, widths, cut shape and dtype)."""
    stages: dict[str, dict[str, Any]] = {}
    for s in topology.stages:
        if s.name not in stage_widths:
            raise SpecError(f"no widths given for stage {s.name!r}")
        w = stage_widths[s.name]
        in_dims = [int(d) for d in w["in_dims"]]
        if len(in_dims) != len(s.inputs):
            raise SpecError(
                f"stage {s.name!r} has {len(s.inputs)} inputs but {len(in_dims)} in_dims"
            )
        stages[s.name] = {
            "owner": s.owner,
            "in_dims": in_dims,
            "out_dim": int(w["out_dim"]),
            "sizes": None if w.get("sizes") is None else [int(x) for x in w["sizes"]],
            **cut_fields(s.name, w),
        }
    return stages


def _check_inputs(
    topology: Topology, features: Mapping[str, int], stages: Mapping[str, Mapping[str, Any]]
) -> None:
    """`build_spec`: every stage input is as wide as what feeds it (`SpecError` otherwise)."""
    for p in topology.feature_parties():
        if p not in features:
            raise SpecError(
                f"no feature count given for party {p!r}, whose stages read "
                "features; add it to the schema"
            )
    for s in topology.stages:
        for i, inp in enumerate(s.inputs):
            want = features[s.owner] if inp == FEATURES else stages[inp]["out_dim"]
            if stages[s.name]["in_dims"][i] != want:
                src = f"{s.owner!r}'s features" if inp == FEATURES else f"stage {inp!r}"
                raise SpecError(
                    f"stage {s.name!r} input {i} ({src}) has width {want} but the "
                    f"stage declares {stages[s.name]['in_dims'][i]}"
                )


def spec_edges(
    topology: Topology, stages: Mapping[str, Mapping[str, Any]], dtype: str = "float32"
) -> list[dict[str, Any]]:
    """The spec's cut edges: each edge of ``topology`` with its width, dtype (the source
    stage's ``out_dtype``, else ``dtype``) and, when not a matrix, its shape."""
    return [
        {
            "src": e.src,
            "dst": e.dst,
            "src_party": e.src_party,
            "dst_party": e.dst_party,
            "width": stages[e.src]["out_dim"],
            "dtype": stages[e.src].get("out_dtype", dtype),
            **({"shape": stages[e.src]["out_shape"]} if "out_shape" in stages[e.src] else {}),
        }
        for e in topology.edges()
    ]


def cut_of(stage: Mapping[str, Any]) -> tuple[list[int], str]:
    """``(out_shape, out_dtype)`` of a spec's stage entry, with their defaults (``[out_dim]``,
    ``"float32"``) when not recorded."""
    shape = stage.get("out_shape", [stage.get("out_dim")])
    return [int(d) for d in shape], str(stage.get("out_dtype", "float32"))


def cut_fields(name: str, widths: Mapping[str, Any]) -> dict[str, Any]:
    """The ``out_shape`` / ``out_dtype`` entries a spec records for a stage: only those that
    differ from the defaults, so a float32 matrix output adds nothing (and hashes as before)."""
    out: dict[str, Any] = {}
    width = int(widths["out_dim"])
    shape = widths.get("out_shape")
    if shape is not None:
        shape = [int(d) for d in shape]
        if not shape or min(shape) < 1 or math.prod(shape) != width:
            raise SpecError(
                f"stage {name!r}: out_shape {shape} must be positive sizes whose product is "
                f"its out_dim {width}"
            )
        if shape != [width]:
            out["out_shape"] = shape
    dtype = str(widths.get("out_dtype", "float32"))
    if dtype not in CUT_DTYPES:
        raise SpecError(
            f"stage {name!r}: out_dtype {dtype!r} is not a cut dtype; choose one of "
            f"{list(CUT_DTYPES)}"
        )
    if dtype != "float32":
        out["out_dtype"] = dtype
    return out


def _plain(value: Any) -> Any:
    """JSON data with tuples as lists and Mappings as dicts (so equal specs compare equal)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _short(commitment: Any) -> str:
    text = str(commitment)
    return text[:4] + ".." if len(text) > 6 else text


def _brief(topology: Mapping[str, Any]) -> str:
    try:
        return ", ".join(f"{s['name']}@{s['owner']}" for s in topology["stages"])
    except (KeyError, TypeError):
        return repr(topology)[:80]


__all__ = [
    "TaskSpec",
    "SpecError",
    "build_spec",
    "cut_fields",
    "cut_of",
    "spec_edges",
    "HYPER_KEYS",
    "SECURITY_KEYS",
]
