"""`CutSum`: a stage that reads the SUM of several parties' cuts, plainly or as a secure sum.

``[model] aggregate`` picks how the star topology's top reads its followers' cuts:

* ``"concat"`` (default): the concatenation, in stage order; no `CutSum`.
* ``"sum"``: the element-wise sum; every follower's cut has the same width ``d`` and the top's
  model reads one input of width ``d``. The baseline of the secure sum: the leader sees each
  follower's activations.
* ``"secure_sum"``: the same sum, computed so the leader learns only the sum. Each follower
  encodes its activations in fixed point in ``Z_2^k`` (`tandem.parties.privacy.fixedpoint.Ring`,
  default ``k = 32`` with scale ``2^-16`` and ``|x| <= 64``) and adds its pairwise masks
  (`tandem.parties.privacy.masks`); the leader adds the K frames mod ``2^k``, the masks cancel,
  and it decodes the sum. One follower's frame alone is uniform noise.

Backward is the same for both: the gradient of a sum with respect to each summand is the
gradient with respect to the sum, so every follower receives the same cut gradient.

Invariants: the summing stage's inputs are all other parties' stages (no local input, no raw
features); all have the same width; with ``"secure_sum"`` there are at least two of them (one
summand would be its own sum) and the ring holds K summands of ``bound``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from tandem.engine.topology import FEATURES, Topology
from tandem.errors import ConfigError

from .fixedpoint import Ring
from .masks import mask

#: ``[model] aggregate`` values
AGGREGATES = ("concat", "sum", "secure_sum")


@dataclasses.dataclass(frozen=True)
class CutSum:
    """How ``stage`` reads its inputs as one sum; ``ring`` only with ``kind == "secure_sum"``.

    A follower adds ``party`` (its name) and ``seeds`` (from `tandem.parties.privacy.masks.
    KeyShare.agree`) with `for_follower`; the summing party needs neither."""

    kind: str
    stage: str
    ring: Ring | None = None
    party: str | None = None
    seeds: Mapping[str, bytes] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in ("sum", "secure_sum"):
            raise ConfigError(
                f"model.aggregate = {self.kind!r} does not sum; accepted values: {list(AGGREGATES)}"
            )
        if self.kind == "secure_sum" and self.ring is None:
            object.__setattr__(self, "ring", Ring())

    @property
    def secure(self) -> bool:
        return self.kind == "secure_sum"

    def for_follower(self, party: str, seeds: Mapping[str, bytes]) -> CutSum:
        return dataclasses.replace(self, party=party, seeds=dict(seeds))

    def spec_fields(self) -> dict:
        """The task-spec entry (part of the spec hash)."""
        out: dict = {"aggregate": self.kind}
        if self.ring is not None:
            out["sum_ring"] = self.ring.to_dict()
        return out

    # -- checks against the topology ------------------------------------------------------------
    def check(self, topology: Topology, out_dims: Mapping[str, int]) -> None:
        """Refuse a summing stage whose inputs are not other parties' cuts of one width."""
        by = topology.by_name
        if self.stage not in by:
            raise ConfigError(
                f"model.aggregate sums the inputs of stage {self.stage!r}, which the topology "
                f"lacks; stages: {sorted(by)}"
            )
        st = by[self.stage]
        local = [i for i in st.inputs if i == FEATURES or by[i].owner == st.owner]
        if local:
            raise ConfigError(
                f"model.aggregate = {self.kind!r} sums the followers' cuts into {st.name!r}, "
                f"but it also reads {local} of its own party; use a topology whose "
                f"{st.name!r} reads only followers (star without leader_bottom)"
            )
        widths = {i: out_dims[i] for i in st.inputs if i in out_dims}
        if len(set(widths.values())) > 1:
            raise ConfigError(
                f"model.aggregate = {self.kind!r} needs every cut into {st.name!r} to have "
                f"one width, got {widths}; give the bottom stages the same model.cut"
            )
        if self.secure:
            if len(st.inputs) < 2:
                raise ConfigError(
                    "model.aggregate = 'secure_sum' needs at least 2 followers (one cut is "
                    "its own sum); use 'concat' or 'sum' for one follower"
                )
            assert self.ring is not None
            self.ring.check_parties(len(st.inputs))

    # -- the follower's side --------------------------------------------------------------------
    def seal(self, x: np.ndarray, step: int, rows: np.ndarray, *, where: str) -> np.ndarray:
        """Follower: ``x`` (float rows ``rows`` of batch ``step``) encoded and masked."""
        assert self.ring is not None and self.party is not None
        x = np.asarray(x)
        flat = x.reshape(x.shape[0], -1)
        words = self.ring.encode(flat, where=where)
        words += mask(self.party, self.seeds, step, rows, flat.shape[1], self.ring.dtype)
        return words

    # -- the summing party's side ---------------------------------------------------------------
    def combine(self, parts: Sequence[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        """Summing party: the float32 sum of the arrived cuts (ring words with a secure sum)."""
        if not self.secure:
            total = np.asarray(parts[0], dtype=np.float32).copy()
            for p in parts[1:]:
                total += p
            return total
        assert self.ring is not None
        acc = np.zeros(parts[0].shape, dtype=self.ring.dtype)
        for p in parts:
            acc += p  # wraps mod 2^k
        return self.ring.decode(acc).reshape((acc.shape[0], *shape))


def from_model(aggregate: str, stage: str, ring: Mapping | None = None) -> CutSum | None:
    """The `CutSum` of ``[model] aggregate`` (None for ``"concat"``); ``ring``: optional
    ``{"bits", "frac", "bound"}``."""
    if aggregate == "concat":
        return None
    if aggregate not in AGGREGATES:
        raise ConfigError(
            f"model.aggregate = {aggregate!r} is not accepted; choose one of {list(AGGREGATES)}"
        )
    r = Ring(**dict(ring)) if ring and aggregate == "secure_sum" else None
    return CutSum(aggregate, stage, r)


# -- the task spec ------------------------------------------------------------------------------
def spec_fields(hyper: Mapping) -> dict:
    """The spec ``hyper`` entries of a cut sum (``aggregate`` and, for ``"secure_sum"``,
    ``sum_ring``); nothing for ``"concat"``, so specs without a sum hash as before."""
    kind = hyper.get("aggregate", "concat")
    if kind == "concat":
        return {}
    out: dict = {"aggregate": kind}
    if kind == "secure_sum":
        out["sum_ring"] = Ring(**dict(hyper.get("sum_ring") or {})).to_dict()
        if hyper.get("sum_offers"):  # the followers' signed key offers, relayed by the leader
            out["sum_offers"] = {str(p): dict(o) for p, o in dict(hyper["sum_offers"]).items()}
    return out


def from_spec(hyper: Mapping, topology: Topology) -> CutSum | None:
    """The `CutSum` a spec's ``hyper`` states (its loss stage sums), or None."""
    fields = spec_fields(hyper)
    if not fields:
        return None
    ring = Ring(**fields["sum_ring"]) if "sum_ring" in fields else None
    return CutSum(fields["aggregate"], topology.loss_stage.name, ring)


def mismatch_reasons(spec_hyper: Mapping, local: Mapping, who: str) -> list[str]:
    """Why ``who``, whose own ``[model]`` states ``local`` (``aggregate`` and the ``sum_*``
    keys as `spec_fields` records them), cannot train the spec's cut sum ([] = agree)."""
    mine, theirs = spec_fields(local), spec_fields(spec_hyper)
    reasons = []
    for key in ("aggregate", "sum_ring"):
        a = mine.get(key, "concat" if key == "aggregate" else None)
        b = theirs.get(key, "concat" if key == "aggregate" else None)
        if a != b:
            reasons.append(
                f"model.{key}: {who} states {a!r} but the leader's spec says {b!r}; "
                "every party must state the same [model] aggregate and sum_* keys"
            )
    return reasons


def ring_channels(spec_hyper: Mapping, topology: Topology) -> dict[str, str]:
    """``{act channel: ring dtype}`` of the cuts a secure sum sends as ring words."""
    cs = from_spec(spec_hyper, topology)
    if cs is None or cs.ring is None:
        return {}
    dst = topology.by_name[cs.stage]
    return {f"act/{i}->{dst.name}": cs.ring.dtype.name for i in dst.inputs}


def hyper_of_model(model: object) -> dict:
    """``[model]``'s cut-sum keys in the spec's form (`spec_fields` of them)."""
    return spec_fields(
        {
            "aggregate": getattr(model, "aggregate", "concat"),
            "sum_ring": {
                "bits": getattr(model, "sum_ring_bits", 32),
                "frac": getattr(model, "sum_frac_bits", 16),
                "bound": getattr(model, "sum_bound", 64.0),
            },
        }
    )
