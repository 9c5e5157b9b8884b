"""``[privacy]``: the defenses of a split-learning job and the leakage audit, as typed data.

Each defense is a table of its own; a table present turns the defense on (absent: off)::

    [privacy]
    seed = 0                       # seeds every defense's randomness (with the step and row id)
    noise_seed = 123456789         # this party's own secret key of its noise (default: key file)
    audit = false                  # each party audits its own secret (tandem.parties.privacy.audit)
    audit_share = 0.01             # share of rows the feature audit's attacker is assumed to hold
    [privacy.gradient_alignment]   # label owner: norm alignment plus noise (Li et al., ICLR 2022)
    norm = 1.0
    noise = 0.5
    [privacy.gradient_dp]          # label owner: per-row clipping plus Gaussian noise
    clip = 1.0
    noise_multiplier = 1.0
    [privacy.label_dp]             # label owner: RR-with-prior (Ghazi et al., 2021)
    epsilon = 2.0
    prior = "labels"
    [privacy.activation_dp]        # feature owners: per-row clipping plus Gaussian noise, accounted
    clip = 1.0
    noise_multiplier = 1.0
    delta = 1e-5
    [privacy.nopeek]               # feature owners: distance-correlation regulariser (NoPeek)
    weight = 0.1

In the Python API the same table is `tandem.parties.split.party.SplitParty`'s ``privacy``
argument (a `Privacy` or a mapping). Negotiation: the leader's `Privacy.spec_fields` (``seed``
and every defense table) go into the task spec's ``hyper["privacy"]`` when any differs from the
defaults, so they are part of the spec hash; a party stating a key otherwise refuses the spec
(`mismatch_reasons`), and every party trains with the leader's. ``audit`` and ``audit_share``
are each party's own (the party whose secret is at stake runs the audit), not negotiated.
``noise_seed`` is each party's own secret: the noise a party adds is keyed by it as well as by
the negotiated ``seed``, which every peer knows; it is never sent. Unset (the default), a
`tandem party` with a checkpoint folder derives it from its key file there
(`tandem.parties.split.process.noise_key`), else the party draws 64 fresh bits from the
operating system when it starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from tandem.errors import ConfigError
from tandem.parties.config import Section

#: the defense tables, in the order a party applies those of one boundary
DEFENSES = ("label_dp", "gradient_alignment", "gradient_dp", "activation_dp", "nopeek")
#: the keys the task spec records (the audit keys are each party's own)
SPEC_KEYS = ("seed", *DEFENSES)


class GradientAlignment(Section):
    """``[privacy.gradient_alignment]``: the label owner rescales each row's cut gradient (of
    that row's own loss, i.e. times the batch rows) to L2 norm ``norm`` and adds Gaussian noise
    of standard deviation ``noise * norm`` per coordinate: the norm attack then reads one value
    for every row, and the noise blurs the direction the cosine attack reads. The
    "norm alignment" baseline plus noise of Li et al., "Label Leakage and Protection in
    Two-party Split Learning", ICLR 2022."""

    norm: float = Field(default=1.0, gt=0, description="L2 norm of every row's cut gradient")
    noise: float = Field(default=0.0, ge=0, description="noise std as a multiple of norm")


class GradientDP(Section):
    """``[privacy.gradient_dp]``: the label owner clips each row's cut gradient (times the
    batch rows) to L2 norm ``clip`` and adds Gaussian noise of std ``noise_multiplier * clip``."""

    clip: float = Field(default=1.0, gt=0, description="L2 bound of a row's cut gradient")
    noise_multiplier: float = Field(default=1.0, ge=0, description="noise std / clip")


class LabelDP(Section):
    """``[privacy.label_dp]``: the label owner replaces its training labels, once before
    training, by randomized response with prior (RR-with-prior, Ghazi et al., "Deep Learning
    with Label Differential Privacy", NeurIPS 2021): epsilon-label-DP for each row. ``prior``:
    ``"labels"`` (the class frequencies of the training labels) or ``"uniform"`` (plain
    randomized response over the classes)."""

    epsilon: float = Field(gt=0, description="the label-DP epsilon")
    prior: Literal["labels", "uniform"] = Field(default="labels", description="the RR prior")


class ActivationDP(Section):
    """``[privacy.activation_dp]``: each feature owner clips each row of the activations it
    sends to L2 norm ``clip`` and adds Gaussian noise of std ``noise_multiplier * clip``; the
    (epsilon, ``delta``) of the composed Gaussian mechanism over the training steps is
    reported per epoch (``privacy_epsilon``, `tandem.parties.privacy.accounting`)."""

    clip: float = Field(default=1.0, gt=0, description="L2 bound of a row's activation")
    noise_multiplier: float = Field(default=1.0, gt=0, description="noise std / clip")
    delta: float = Field(default=1e-5, gt=0, lt=1, description="the accounted delta")


class NoPeek(Section):
    """``[privacy.nopeek]``: each feature owner adds ``weight`` times the distance
    correlation between a batch's raw features and its bottom model's activations to its
    bottom's loss (NoPeek, Vepakomma et al., "NoPeek: Information leakage reduction to share
    activations in distributed deep learning", 2020)."""

    weight: float = Field(default=0.1, gt=0, description="weight of the distance correlation")


class Privacy(Section):
    """``[privacy]``: see the module docstring. Every field has a default: all defenses off."""

    seed: int = Field(default=0, description="seeds the defenses' noise (with step and row id)")
    noise_seed: int | None = Field(
        default=None,
        ge=0,
        lt=2**64,
        description="this party's own secret key of its defenses' noise, never sent; "
        "unset: from its key file beside the checkpoints (tandem party), else fresh from the "
        "operating system at every start",
    )
    audit: bool = Field(default=False, description="audit what the shared tensors reveal")
    audit_share: float = Field(
        default=0.01, gt=0, lt=1, description="share of rows the feature audit's attacker holds"
    )
    gradient_alignment: GradientAlignment | None = None
    gradient_dp: GradientDP | None = None
    label_dp: LabelDP | None = None
    activation_dp: ActivationDP | None = None
    nopeek: NoPeek | None = None

    @property
    def defended(self) -> bool:
        """Whether any defense is on."""
        return any(getattr(self, k) is not None for k in DEFENSES)

    def spec_fields(self) -> dict[str, Any]:
        """The task spec's ``hyper["privacy"]`` entry: ``{"privacy": {seed, defenses...}}``
        when a defense is on or the seed is not 0, else ``{}`` (so a spec without privacy
        hashes as before)."""
        if not self.defended and self.seed == 0:
            return {}
        return {"privacy": self.model_dump(include=set(SPEC_KEYS), exclude_none=True)}

    def stated(self) -> dict[str, Any]:
        """The negotiated keys this configuration states (those given explicitly)."""
        return self.model_dump(include=set(SPEC_KEYS) & self.model_fields_set)


def privacy_from(value: Privacy | Mapping[str, Any] | None) -> Privacy:
    """A `Privacy` from itself, a mapping (a spec's ``hyper["privacy"]`` or a TOML table), or
    None (all off)."""
    if value is None:
        return Privacy()
    if isinstance(value, Privacy):
        return value
    return Privacy.model_validate(dict(value), strict=False)


def checked(value: Privacy | Mapping[str, Any] | None, *, loss: str) -> Privacy:
    """`privacy_from` ``value``, checked against the run's ``loss``: label DP randomizes
    classes, so it needs ``"binary"`` or ``"softmax"``; `ConfigError` naming the key and the
    fix otherwise (also for a malformed mapping)."""
    try:
        privacy = privacy_from(value)
    except ValueError as exc:
        raise ConfigError(f"[privacy] is malformed: {exc}") from None
    if privacy.label_dp is not None and loss not in ("binary", "softmax"):
        raise ConfigError(
            f"privacy.label_dp randomizes class labels, but loss is {loss!r}; use it with "
            'loss = "binary" or "softmax", or remove [privacy.label_dp]'
        )
    return privacy


def agreed(spec_privacy: Mapping[str, Any] | None, local: Privacy | None = None) -> Privacy:
    """The `Privacy` a party trains with: the spec's negotiated keys (``hyper["privacy"]``;
    absent: all off), with the party's own ``audit``, ``audit_share`` and ``noise_seed`` from
    ``local``."""
    own = (local or Privacy()).model_dump(include={"audit", "audit_share", "noise_seed"})
    return privacy_from({**privacy_from(spec_privacy).model_dump(include=set(SPEC_KEYS)), **own})


def mismatch_reasons(
    spec_privacy: Mapping[str, Any] | None, stated: Mapping[str, Any]
) -> list[str]:
    """Why a party refuses a spec whose privacy differs from what it states ([] = agree):
    one ``privacy.KEY: leader says X, this party says Y`` per differing key of ``stated``
    (`Privacy.stated`; keys it does not state it adopts from the leader)."""
    leader = privacy_from(spec_privacy).model_dump(include=set(SPEC_KEYS))
    mine = privacy_from(stated).model_dump(include=set(SPEC_KEYS))
    return [
        f"privacy.{key}: leader says {_show(leader[key])}, this party says {_show(mine[key])}; "
        f"state the leader's value in [privacy] (or remove {key}: a party adopts the leader's)"
        for key in SPEC_KEYS
        if key in stated and leader[key] != mine[key]
    ]


def _show(value: Any) -> str:
    return "off" if value is None else repr(value)


__all__ = [
    "DEFENSES",
    "SPEC_KEYS",
    "ActivationDP",
    "GradientAlignment",
    "GradientDP",
    "LabelDP",
    "NoPeek",
    "Privacy",
    "agreed",
    "checked",
    "mismatch_reasons",
    "privacy_from",
]
