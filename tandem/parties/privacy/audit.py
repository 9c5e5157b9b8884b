"""The leakage audit: each party scores, on its own data, what it sends (docs/privacy.md).

A `PartyAudit` observes every cut tensor its party sends in a training batch
(`StageHandler` calls `sent`, after any defense and before compression) and keeps, per epoch,
a seeded reservoir of at most ``rows`` rows (Vitter's algorithm R), so its memory is bounded
whatever the epoch's size. At the end of each epoch (`end_epoch`) it reports:

* ``audit_norm_auc``, ``audit_cosine_auc`` (the label owner, for its outgoing gradients): the
  AUC the norm and the direction attacks of `tandem.parties.privacy.attacks` reach against its
  labels. The direction attack's known positive is one positive row of each batch, drawn with
  the audit's seed, as an attacker who knows one example per batch would hold; a batch without
  a positive row gives no direction scores. With several gradient channels (K followers), each
  channel is what one follower sees: the reported AUC is the largest (the worst follower).
  Only binary labels are scored (the attacks are defined for them); with a ``softmax`` or
  ``mse`` loss no gradient rows are kept and ``audit_label_skipped`` says why.
* ``audit_feature_r2`` (a feature owner, for its outgoing activations): the held-out R^2 of a
  ridge decoder from the activations to this party's features, fitted on a ``share`` of the
  sampled rows (`attacks.decoder_r2`); the largest over its activation channels.

Every value is None where undefined (one class only, too few rows). Cost when the audit is off:
none, since no `PartyAudit` exists and nothing is captured.

Invariant: ``_batch`` holds only the current training batch's gradient rows (at most the batch
size), flushed into the reservoirs by `new_batch` and `end_epoch`; each reservoir holds at most
``settings.rows`` rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tandem.errors import ConfigError

from .attacks import attack_auc, cosine_scores, decoder_r2, flat_rows, norm_scores

#: The keys an epoch's audit record may carry (values: float or None).
KEYS = ("audit_norm_auc", "audit_cosine_auc", "audit_feature_r2")


@dataclasses.dataclass(frozen=True)
class AuditSettings:
    """Whether a party audits what it sends (``[privacy] audit``), the share of sampled rows
    the feature decoder is fitted on (``[privacy] audit_share``, as leaked rows an attacker
    could hold), the seed of its sampling, and the rows it samples per epoch and channel."""

    enabled: bool = False
    share: float = 0.01
    seed: int = 0
    rows: int = 100_000

    def __post_init__(self) -> None:
        if not 0 < self.share < 1:
            raise ConfigError(
                f"privacy.audit_share must be in (0, 1) (the share of rows the feature decoder "
                f"is fitted on), got {self.share}"
            )
        if self.rows < 100:
            raise ConfigError(
                f"the audit's sample must hold at least 100 rows per epoch, got {self.rows}"
            )


class Reservoir:
    """A uniform sample of at most ``size`` rows of everything `add`ed (algorithm R), drawn
    by ``rng``; ``columns`` arrays of one row per sample are kept side by side."""

    def __init__(self, size: int, rng: np.random.Generator) -> None:
        self.size, self.rng = size, rng
        self.seen = 0
        self.columns: list[np.ndarray] | None = None

    def add(self, *columns: np.ndarray) -> None:
        k = len(columns[0])
        if k == 0:
            return
        if self.columns is None:
            self.columns = [np.empty((self.size, *c.shape[1:]), c.dtype) for c in columns]
        idx = np.arange(self.seen, self.seen + k)
        # row t (0-based) fills slot t while there is room, else replaces a uniform slot
        # of [0, t] when that slot is in the reservoir
        slot = np.where(idx < self.size, idx, self.rng.integers(0, idx + 1))
        keep = slot < self.size
        src, dst = np.flatnonzero(keep)[::-1], slot[keep][::-1]
        dst, first = np.unique(dst, return_index=True)  # the last row to reach a slot wins
        for col, new in zip(self.columns, columns, strict=True):
            col[dst] = new[src[first]]
        self.seen += k

    def sample(self) -> list[np.ndarray]:
        """The kept rows of each column (fewer than ``size`` while fewer were added)."""
        n = min(self.seen, self.size)
        return [] if self.columns is None else [c[:n] for c in self.columns]


class PartyAudit:
    """The audit of one party (see the module docstring). ``loss``: the task's loss name
    (which says how labels are scored)."""

    def __init__(self, settings: AuditSettings, loss: str) -> None:
        self.settings, self.loss = settings, loss
        #: one record per epoch ended: ``epoch`` and the `KEYS` this party measures
        self.history: list[dict[str, Any]] = []
        #: the epoch whose rows are being sampled (set by `at_epoch`), or None
        self.open: int | None = None
        self._start(0)

    def _start(self, epoch: int) -> None:
        self._rng = np.random.default_rng([self.settings.seed, epoch])
        self._grads: dict[str, Reservoir] = {}
        self._acts: dict[str, Reservoir] = {}
        self._batch: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self.rows_seen = 0
        self._skipped = False

    def _reservoir(self, table: dict[str, Reservoir], channel: str) -> Reservoir:
        if channel not in table:
            table[channel] = Reservoir(self.settings.rows, self._rng)
        return table[channel]

    # -- what the stage handler calls ------------------------------------------------------
    def sent(
        self,
        channel: str,
        tensor: np.ndarray,
        labels: np.ndarray | None,
        features: Callable[[], np.ndarray | None],
    ) -> None:
        """Observe ``tensor`` (rows of a training batch) sent on ``channel``: a gradient
        (``grad/...``) with the ``labels`` of its rows, or an activation (``act/...``) with
        ``features()``, this party's feature rows of the same samples (called only here)."""
        if channel.startswith("grad/"):
            if labels is None:
                return
            if self.loss == "binary":
                self._batch.setdefault(channel, []).append((flat_rows(tensor), labels))
            else:
                self._skipped = True
        elif channel.startswith("act/"):
            feats = features()
            if feats is not None:
                self._reservoir(self._acts, channel).add(
                    flat_rows(tensor).astype(np.float32), flat_rows(feats).astype(np.float32)
                )
                self.rows_seen += len(tensor)

    def new_batch(self) -> None:
        """A training batch begins: score the previous batch's gradients into the sample."""
        for channel, parts in self._batch.items():
            g = np.concatenate([p[0] for p in parts])
            y = np.concatenate([np.asarray(p[1]).reshape(len(p[1]), -1)[:, 0] for p in parts])
            cos = np.full(len(g), np.nan)
            pos = np.flatnonzero(y > 0.5)
            if len(pos):
                cos = cosine_scores(g, int(self._rng.choice(pos)))
            self._reservoir(self._grads, channel).add(norm_scores(g), cos, y.astype(np.float64))
            self.rows_seen += len(g)
        self._batch = {}

    # -- epochs ----------------------------------------------------------------------------
    def at_epoch(self, epoch: int) -> None:
        """A training batch of ``epoch`` is about to run (a follower learns epochs from the
        leader's commands): ends the epoch sampled so far if it is another one."""
        if self.open is not None and self.open != epoch:
            self.end_epoch(self.open)
        self.open = epoch

    def command(self, meta: Mapping[str, Any]) -> None:
        """A follower got the leader's command ``meta``: ``stop`` ends the open epoch
        (`close`), a training batch's opens its ``epoch`` (`at_epoch`); others change nothing."""
        if meta.get("cmd") == "stop":
            self.close()
        elif meta.get("cmd") == "batch" and meta.get("mode") == "train":
            self.at_epoch(int(meta.get("epoch", 0)))

    def close(self) -> None:
        """Training ended: end the epoch still open (if any)."""
        if self.open is not None:
            self.end_epoch(self.open)

    def summary(self) -> dict[str, Any]:
        """The last epoch's `KEYS` (and ``audit_label_skipped``), for a run's final JSON line;
        ``{}`` before any epoch ended."""
        if not self.history:
            return {}
        return {k: v for k, v in self.history[-1].items() if k.startswith("audit_")}

    def end_epoch(self, epoch: int) -> dict[str, Any]:
        """Close ``epoch``: its record (appended to ``history``); the next epoch starts a fresh
        sample. An epoch in which nothing was sent records nothing and returns ``{}``."""
        self.new_batch()
        self.open = None
        record: dict[str, Any] = {}
        if self._grads:
            record.update(self._label_record())
        elif self._skipped:
            record["audit_label_skipped"] = (
                f"the norm and direction attacks score binary labels; a {self.loss!r} task's "
                "labels are not audited"
            )
        if self._acts:
            r2s = [self._r2(res) for res in self._acts.values()]
            record["audit_feature_r2"] = _worst(r2s)
        if record:
            record = {"epoch": epoch, **record, "audit_rows": self.rows_seen}
            self.history.append(record)
        self._start(epoch + 1)
        return record

    def _label_record(self) -> dict[str, Any]:
        norms, coss = [], []
        for res in self._grads.values():
            norm, cos, y = res.sample()
            positive = y > 0.5
            norms.append(attack_auc(norm, positive))
            ok = np.isfinite(cos)
            coss.append(attack_auc(cos[ok], positive[ok]) if ok.any() else None)
        return {"audit_norm_auc": _worst(norms), "audit_cosine_auc": _worst(coss)}

    def _r2(self, res: Reservoir) -> float | None:
        acts, feats = res.sample()
        return decoder_r2(acts, feats, self.settings.share, self._rng)


def make_audit(settings: AuditSettings | None, loss: str) -> PartyAudit | None:
    """The `PartyAudit` of ``settings`` for a task of ``loss``; None when off (or None)."""
    return PartyAudit(settings, loss) if settings is not None and settings.enabled else None


def _worst(values: list[float | None]) -> float | None:
    """The largest defined value (the most leaking channel), or None."""
    known = [v for v in values if v is not None and math.isfinite(v)]
    return max(known) if known else None


__all__ = ["KEYS", "AuditSettings", "PartyAudit", "Reservoir", "make_audit"]
