"""`setup`: what a split-learning party's ``[privacy]`` section makes of its labels and audit.

One place turns a party's ``privacy`` argument, labels and audit settings into what it trains
with: the checked `Privacy`, the labels the loss reads (the training labels randomized once by
label DP when it is on, `tandem.parties.privacy.label.randomize_labels`), the labels the audit
scores against (always the true ones: the secret the label owner protects, never the
randomized copy), and the `PartyAudit` (None when off).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from tandem.errors import ConfigError

from .audit import AuditSettings, PartyAudit, make_audit
from .config import Privacy, checked
from .label import randomize_labels
from .noise import party_secret


@dataclasses.dataclass(frozen=True)
class PartyPrivacy:
    """A party's privacy set-up. Invariant: ``secret`` and ``labels`` have the same datasets
    and shapes; they differ only in ``labels["train"]`` and only when label DP is on."""

    privacy: Privacy
    #: dataset -> the labels training and evaluation read
    labels: dict[str, np.ndarray]
    #: dataset -> the true labels (what the audit scores the sent gradients against)
    secret: dict[str, np.ndarray]
    audit: PartyAudit | None

    def require(self, party: str, dataset: str) -> np.ndarray:
        """The labels of ``dataset`` that ``party`` (owning the loss stage) trains on;
        `ConfigError` naming the dataset and the fix when it has none."""
        if dataset not in self.labels:
            raise ConfigError(
                f"{party!r} owns the loss stage and needs labels to train on "
                f"{dataset!r}: pass labels={{{dataset!r}: y}}"
            )
        return self.labels[dataset]

    def batch(
        self, party: str, dataset: str, idx: np.ndarray, needed: bool
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """``(labels trained on, true labels)`` of rows ``idx`` of ``dataset`` when ``needed``
        (a training batch of the loss owner; `require` checks them), else ``(None, None)``."""
        if not needed:
            return None, None
        return self.require(party, dataset)[idx], self.secret[dataset][idx]


def setup(
    privacy: Privacy | Mapping[str, Any] | None,
    labels: Mapping[str, np.ndarray] | None,
    *,
    loss: str,
    audit: AuditSettings | None = None,
) -> PartyPrivacy:
    """The `PartyPrivacy` of a party's ``privacy`` argument (checked against ``loss``,
    `tandem.parties.privacy.config.checked`), its ``labels`` (``{}`` for a party without) and
    its ``audit`` settings (None: as ``privacy.audit`` and ``privacy.audit_share`` say, seeded
    by ``privacy.seed``)."""
    checked_privacy = checked(privacy, loss=loss)
    secret = {k: np.asarray(v) for k, v in (labels or {}).items()}
    trained = dict(secret)
    label_dp = checked_privacy.label_dp
    if label_dp is not None and "train" in trained:  # RR-with-prior, once, keyed by row
        trained["train"] = randomize_labels(
            trained["train"],
            label_dp,
            loss=loss,
            seed=checked_privacy.seed,
            secret=party_secret(checked_privacy.noise_seed),
        )
    if audit is None and checked_privacy.audit:
        audit = AuditSettings(True, checked_privacy.audit_share, seed=checked_privacy.seed)
    return PartyPrivacy(checked_privacy, trained, secret, make_audit(audit, loss))


__all__ = ["AuditSettings", "PartyPrivacy", "Privacy", "setup"]
