"""`CutDefenses`: the ``[privacy]`` defenses one party applies where it produces cut tensors.

`tandem.parties.split.stages.StageHandler` holds one and calls it at two narrow hooks:

* `CutDefenses.outgoing` on each training op's outgoing tensor, before it is split into chunks
  and before cut compression (so a compressor encodes the defended tensor): the label owner's
  gradient defenses on ``grad/*`` channels, activation DP on ``act/*`` channels;
* `CutDefenses.regularise` at a stage's update: NoPeek's gradient added to a bottom stage's
  batch gradient.

Order on one tensor: gradient alignment, then gradient DP (label owner); activation DP (feature
owner); then the cut compressor. All randomness is keyed by ``[privacy] seed``, the party's own
secret (`tandem.parties.privacy.noise.party_secret`), the training step, the stage and the row
id.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from .config import Privacy
from .feature import defend_activation, nopeek_grads
from .label import defend_gradient
from .noise import party_secret, stage_tag


class CutDefenses:
    """The defenses of ``privacy`` one party applies (``label_owner``: it owns the loss stage,
    so its gradient defenses apply). ``nopeek_stages``: stage -> model ``apply`` of the bottom
    stages NoPeek regularises (stages that read only raw features and send their output)."""

    def __init__(
        self,
        privacy: Privacy | None = None,
        *,
        label_owner: bool = False,
        nopeek_stages: Mapping[str, Callable[..., Any]] | None = None,
    ) -> None:
        self.privacy = privacy or Privacy()
        p = self.privacy
        self.gradients = label_owner and (
            p.gradient_alignment is not None or p.gradient_dp is not None
        )
        self.activations = p.activation_dp is not None
        #: keys this party's noise with the seed: never sent (a peer holding it and the seed
        #: could regenerate the noise and subtract it)
        self.secret = party_secret(p.noise_seed)
        self._nopeek = (
            {s: nopeek_grads(apply) for s, apply in (nopeek_stages or {}).items()}
            if p.nopeek is not None
            else {}
        )

    @property
    def active(self) -> bool:
        """Whether `outgoing` changes anything."""
        return self.gradients or self.activations

    def outgoing(
        self, channel: str, x: Any, *, ids: np.ndarray, step: int, rows: int
    ) -> np.ndarray | Any:
        """``x``, rows ``ids`` of a training batch of ``rows`` rows at ``step``, as sent on
        ``channel`` (unchanged when no defense applies to it)."""
        kind, _, edge = channel.partition("/")
        tag = stage_tag(edge.partition("->")[0])
        p = self.privacy
        if kind == "grad" and self.gradients:
            return defend_gradient(
                np.asarray(x),
                alignment=p.gradient_alignment,
                dp=p.gradient_dp,
                seed=p.seed,
                secret=self.secret,
                step=step,
                ids=ids,
                rows=rows,
                stage=tag,
            )
        if kind == "act" and p.activation_dp is not None:
            return defend_activation(
                np.asarray(x),
                p.activation_dp,
                seed=p.seed,
                secret=self.secret,
                step=step,
                ids=ids,
                stage=tag,
            )
        return x

    def regularise(self, stage: str, params: Any, grads: Any, features: Any) -> Any:
        """``grads`` plus NoPeek's gradient over the batch's ``features`` for a regularised
        ``stage`` (``grads`` unchanged for any other)."""
        if stage not in self._nopeek or self.privacy.nopeek is None:
            return grads
        extra = self._nopeek[stage](
            params, np.asarray(features, np.float32), np.float32(self.privacy.nopeek.weight)
        )
        return jax.tree.map(lambda g, e: g + e.astype(g.dtype), grads, extra)


__all__ = ["CutDefenses"]
