"""Federated preprocessing: one state fitted from every client's summary, used by all.

Before round one, each client sends a summary of its training rows in its ``hello``
(`tandem.parties.data.summary`: sums, sums of squares and counts of the numeric features,
value counts of the categorical ones; no row). The server merges the summaries of the first
``server.min_clients`` clients into one `Preprocessing` (``[preprocessing] min_count``: a
categorical value enters the vocabulary only when that many training rows hold it), puts it in
the `Task` of every ``welcome``, evaluates on its own rows under it and stores it in the export.
Every party therefore scales and encodes exactly as the export does at prediction.

Under secure aggregation the numeric sums travel through the secure sum instead
(`tandem.parties.fl.summary_exchange`, `tandem.parties.fl.secure_summary`): the server learns
their totals only. A categorical column then needs hashed buckets (``[data] hash_buckets``) or
declared values (``data.vocabularies``), unless ``[preprocessing] reveal_categories = true``
lets the clients send their value counts in the clear; ``max_abs`` bounds every numeric value
so the secure sum cannot overflow.

``[preprocessing] mode = "per_client"`` keeps the old behaviour, each client fitting on its own
rows; its clients warn on stderr (their inputs then mean different things on each client).

Features as the model sees them: float32 ``[numeric | categorical codes]`` (codes as whole
numbers, the layout of split learning and of `tandem.parties.models.embedding_mlp`, whose
``vocab`` the server fills in from the merged vocabularies when the ``[model]`` table leaves it
out).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from pydantic import Field

from tandem.parties.config import Section
from tandem.parties.data import DataConfig, PartyDataset, Preprocessing
from tandem.parties.data.preprocess import Features

MODES = ("global", "per_client")


class PreprocessingTable(Section):
    """``[preprocessing]`` of the server's TOML."""

    mode: Literal["global", "per_client"] = Field(
        default="global",
        description="global: one state from every client's summary; per_client: each its own",
    )
    min_count: int = Field(
        default=1, ge=1, description="training rows a categorical value needs, over all clients"
    )
    max_abs: float = Field(
        default=1e12,
        gt=0,
        description="under [secagg]: the largest |value| of a numeric feature (the secure "
        "sum of the summaries refuses larger ones, so it cannot overflow)",
    )
    reveal_categories: bool = Field(
        default=False,
        description="under [secagg]: let clients send their categorical value counts in the "
        "clear (else hash the columns, data.hash_buckets, or declare data.vocabularies)",
    )


def feature_matrix(features: Features) -> np.ndarray:
    """float32 ``[numeric | codes]`` (the module docstring's layout)."""
    if not features.categorical.shape[1]:
        return np.asarray(features.numeric, np.float32)
    return np.concatenate(
        [features.numeric, features.categorical.astype(np.float32)], axis=1, dtype=np.float32
    )


def apply_state(cfg: DataConfig, data: PartyDataset, state: Preprocessing) -> np.ndarray:
    """The feature matrix of ``data``'s rows (in its order) under ``state`` instead of the
    state ``data`` was fitted with; the table is read again (blocking)."""
    from tandem.parties.data.load import _in, _read

    with _in(cfg):
        table = _read(cfg, _columns(cfg, state))
        return feature_matrix(state.transform(table, data.rows))


def _columns(cfg: DataConfig, state: Preprocessing) -> list[str] | None:
    if state.all_columns:
        return None
    named = [c for c in (cfg.id_column,) if c is not None]
    return list(dict.fromkeys([*named, *state.columns]))


def global_state(
    cfg: DataConfig, summaries: Mapping[str, Mapping[str, Any]], min_count: int
) -> Preprocessing:
    """The merged state (`tandem.parties.data.summary.merge`) of ``summaries`` under the
    server's ``[data]`` ``cfg`` (its table fixes the feature columns; blocking)."""
    from tandem.parties.data.load import _in, _read
    from tandem.parties.data.summary import _needed, merge

    with _in(cfg):
        table = _read(cfg, _needed(cfg))
        return merge(summaries, cfg, table, min_count=min_count)


def with_vocab(model: Mapping[str, Any], state: Preprocessing) -> dict[str, Any]:
    """``model`` with an ``embedding`` model's ``vocab`` set from ``state`` when it is absent."""
    spec = dict(model)
    if spec.get("kind") == "embedding" and "vocab" not in spec:
        spec["vocab"] = [v.size for v in state.vocabularies]
    return spec


__all__ = [
    "MODES",
    "PreprocessingTable",
    "apply_state",
    "feature_matrix",
    "global_state",
    "with_vocab",
]
