"""The ``[optimizer]`` and ``[compression]`` tables of a federated TOML file (read by
`tandem.parties.fl.config`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax
from pydantic import Field, ValidationInfo, field_validator, model_validator

from tandem.errors import ConfigError
from tandem.parties.config import Section
from tandem.parties.config.base import Invalid

from .downlink import MODES

PRESETS = ("dense", "compressed")


class OptimizerConfig(Section):
    """``[optimizer]``: ``optax.<name>(**kwargs)``, the server's (or a client's local)
    optimizer; every key but ``name`` is a keyword argument of it."""

    model_config = {**Section.model_config, "extra": "allow"}

    name: str | None = Field(default=None, description='an optax optimizer: "sgd", "adam", ...')

    @model_validator(mode="after")
    def _optax(self) -> OptimizerConfig:
        from .build import build_optimizer

        if not self.name:
            raise Invalid(
                "",
                '[optimizer] needs `name`, an optax optimizer such as "sgd", "adam" or '
                f'"yogi", got {self.name!r}',
            )
        try:
            build_optimizer(self.name, self.kwargs)
        except ConfigError as exc:
            raise Invalid("", str(exc)) from None
        return self

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def build(self) -> optax.GradientTransformation:
        from .build import build_optimizer

        return build_optimizer(str(self.name), self.kwargs)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **self.kwargs}


class CompressionConfig(Section):
    """``[compression]``: ``preset`` "dense" (dense uplink, full downlink) or "compressed"
    (rand-k uplink keeping 1/``uplink_ratio`` of the coordinates, or a count sketch of that
    size with ``sketch``; error feedback applying the top 1/``topk_ratio``; ``downlink``
    deltas; ``downlink`` defaults to "full" for dense and "version" for compressed).
    A compressed federation starts dense: ``warmup_rounds`` dense rounds, then ``ramp_rounds``
    rounds whose share of coordinates falls geometrically to the configured one
    (`tandem.parties.fl.warmup`). ``uplink_bits`` (2, 4, 8) replaces rand-k by a
    block-quantized uplink with the clients' error feedback (`tandem.parties.fl.quantize`)."""

    preset: str = "dense"
    uplink_ratio: int = Field(default=60, ge=1)
    topk_ratio: int = Field(default=50, ge=1)
    sketch: bool = False
    downlink: str = "full"
    anchor_every: int = Field(default=10, ge=1)
    log_size: int = Field(default=16, ge=1)
    lossless: bool = False
    warmup_rounds: int = Field(default=2, ge=0, description="dense rounds first (compressed)")
    ramp_rounds: int = Field(default=4, ge=0, description="rounds from dense to the ratios")
    uplink_bits: int = Field(
        default=0, description="2, 4 or 8: a block-quantized uplink with error feedback; 0: off"
    )
    quant_block: int = Field(default=256, ge=1, description="coordinates per quantized block")
    feedback_max_gap: int = Field(
        default=3, ge=0, description="rounds a client keeps its quantization residual"
    )

    @model_validator(mode="before")
    @classmethod
    def _downlink(cls, table: Any) -> Any:
        if isinstance(table, Mapping) and "downlink" not in table:
            mode = "version" if table.get("preset") == "compressed" else "full"
            return {**table, "downlink": mode}
        return table

    @field_validator("preset", "downlink")
    @classmethod
    def _choice(cls, value: str, info: ValidationInfo) -> str:
        choices = PRESETS if info.field_name == "preset" else MODES
        if value not in choices:
            raise Invalid("", f"must be one of {list(choices)}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _knobs(self) -> CompressionConfig:
        named = (
            {"uplink_ratio", "topk_ratio", "sketch", "warmup_rounds", "ramp_rounds"}
            | {"uplink_bits", "quant_block", "feedback_max_gap"}
        ) & self.model_fields_set
        knobs = sorted(named)
        if self.preset == "dense" and knobs:
            raise Invalid(
                "",
                f'compression {knobs} apply to preset = "compressed" only; remove them or set '
                'preset = "compressed"',
            )
        if self.uplink_bits not in (0, 2, 4, 8):
            raise Invalid("", f"uplink_bits must be 0 (off), 2, 4 or 8, got {self.uplink_bits}")
        unused = sorted({"uplink_ratio", "topk_ratio", "sketch"} & self.model_fields_set)
        if self.uplink_bits and unused:
            raise Invalid(
                "",
                f"compression {unused} do not apply with uplink_bits = {self.uplink_bits} (a "
                "quantized uplink sends every coordinate and the server applies them all); "
                "remove them or set uplink_bits = 0",
            )
        return self

    def warmup(self) -> Any:
        """The compressed preset's `tandem.parties.fl.warmup.Warmup` (None when it is off)."""
        from .warmup import Warmup

        if self.warmup_rounds == 0 and self.ramp_rounds == 0:
            return None
        return Warmup(self.warmup_rounds, self.ramp_rounds)


__all__ = ["PRESETS", "CompressionConfig", "OptimizerConfig"]
