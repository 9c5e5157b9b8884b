"""The split-learning hyper-parameters, declared once: the ``[train]`` section.

Each field of `Train` is a TOML key of ``[train]``; its ``json_schema_extra["role"]`` says
where else it goes:

- ``"split"``: a `tandem.parties.split.settings.SplitConfig` field and hashed in the task spec;
- ``"spec"``: hashed in the task spec only (``eval_batch_size``);
- ``"report"``: the leader's reporting (`tandem.parties.split.reporting`), in no spec.

`SPLIT_FIELDS`, `SPEC_FIELDS` and the spec's ``hyper`` keys (`HYPER_KEYS`, with
``checkpoint_every`` from ``[checkpoint] every``) all derive from it. Values are range-checked
where they are used (`SplitConfig`, `tandem.parties.split.compress`, the reporting config), so
a message names the fix there.

The other negotiated section is ``[privacy]`` (`tandem.parties.privacy.config.Privacy`): a table
of its own, carried as `SplitConfig`'s last field ``privacy`` and recorded in the spec's
``hyper["privacy"]`` (`Privacy.spec_fields`).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tandem.parties.config import Section


def _role(role: str) -> dict[str, Any]:
    return {"role": role}


class Train(Section):
    """``[train]``: the leader's training settings (a follower may state only the cut
    compression, which it then checks against the leader's spec)."""

    batch_size: int = Field(default=64, json_schema_extra=_role("split"))
    epochs: int = Field(default=10, json_schema_extra=_role("split"))
    groups: int | str = Field(
        default="auto",
        description='micro-batches per batch, or "auto"',
        json_schema_extra=_role("split"),
    )
    chunks: int = Field(
        default=1, description="messages per group each way", json_schema_extra=_role("split")
    )
    learning_rate: float = Field(default=1e-2, json_schema_extra=_role("split"))
    optimizer: str = Field(default="adam", json_schema_extra=_role("split"))
    loss: str = Field(default="binary", json_schema_extra=_role("split"))
    seed: int = Field(default=0, json_schema_extra=_role("split"))
    threshold: int = Field(
        default=4, description="outbound groups before local work", json_schema_extra=_role("split")
    )
    capacity: int = Field(
        default=8, description="outbound groups at most", json_schema_extra=_role("split")
    )
    policy: str = Field(default="priority", json_schema_extra=_role("split"))
    compress: str = Field(
        default="none", description="cut-layer compression", json_schema_extra=_role("split")
    )
    compress_topk: float = Field(
        default=0.1, description='share of a row "topk" sends', json_schema_extra=_role("split")
    )
    eval_batch_size: int | None = Field(
        default=None,
        description="rows per evaluation batch (default max(batch_size, 256))",
        json_schema_extra=_role("spec"),
    )
    monitor: str | None = Field(
        default=None,
        description="the metric that picks the best epoch",
        json_schema_extra=_role("report"),
    )
    patience: int | None = Field(default=None, json_schema_extra=_role("report"))
    min_delta: float | None = Field(default=None, json_schema_extra=_role("report"))
    restore_best: bool | None = Field(default=None, json_schema_extra=_role("report"))

    def given(self) -> dict[str, Any]:
        """The keys the file states, as TOML gave them."""
        return self.model_dump(include=self.model_fields_set)


def _fields(*roles: str) -> tuple[str, ...]:
    return tuple(
        name
        for name, f in Train.model_fields.items()
        if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("role") in roles
    )


#: `SplitConfig`'s fields, in declaration order.
SPLIT_FIELDS = _fields("split")
#: The fields the task spec hashes (its ``hyper`` table, with ``checkpoint_every``).
SPEC_FIELDS = _fields("split", "spec")
#: The reporting keys: the leader's alone, in no spec.
REPORT_FIELDS = _fields("report")
#: The [train] keys a follower may state: it checks them against the leader's spec.
FOLLOWER_TRAIN_KEYS = ("compress", "compress_topk")
#: Spec fields recorded with their declared default when a caller omits them; ``compress_topk``
#: is recorded with ``compress = "topk"`` alone (`CutCompressor.spec_fields`).
SPEC_DEFAULTS = {k: Train.model_fields[k].default for k in ("chunks", "compress")}
#: The spec's ``hyper`` keys a caller must give (the rest of `SPEC_FIELDS` has defaults).
HYPER_KEYS = (
    *(k for k in SPEC_FIELDS if k not in (*SPEC_DEFAULTS, "compress_topk")),
    "checkpoint_every",
)

__all__ = [
    "FOLLOWER_TRAIN_KEYS",
    "HYPER_KEYS",
    "REPORT_FIELDS",
    "SPEC_DEFAULTS",
    "SPEC_FIELDS",
    "SPLIT_FIELDS",
    "Train",
]
