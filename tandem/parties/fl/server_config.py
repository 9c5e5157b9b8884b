"""What a federated server decides: `FLConfig` (docs/federated.md has each option).

The checks here refuse the combinations that cannot hold (differential privacy without the
mean, distributed noise without secure aggregation, ...), naming the keys and the fix.
"""

from __future__ import annotations

import dataclasses

import optax

from tandem.errors import ConfigError

from .aggregate import ServerRule
from .aggregator import Aggregator, check_secure, weighted_mean
from .dp import DPConfig
from .secagg import SecAggConfig
from .warmup import Warmup


@dataclasses.dataclass(frozen=True)
class FLConfig:
    """Everything the server decides. See docs/federated.md for each option."""

    rounds: int = 50
    fraction: float = 0.5
    round_timeout: float = 30.0
    seed: int = 0
    uplink: dict = dataclasses.field(default_factory=lambda: {"kind": "dense"})
    rule: ServerRule = ServerRule()
    downlink: str = "full"
    log_size: int = 16
    anchor_every: int = 10
    lossless: bool = False
    sketch_median: bool = True
    eval_every: int = 1
    max_update_bytes: int | None = None
    optimizer: optax.GradientTransformation | None = None
    aggregator: Aggregator = weighted_mean()
    secagg: SecAggConfig | None = None
    dp: DPConfig | None = None
    warmup: Warmup | None = None  # the compression ramp (`warmup`): dense rounds first
    client_eval: bool = False  # federated evaluation (`tandem.parties.fl.evaluation`)

    def __post_init__(self) -> None:
        if self.secagg is not None:
            check_secure(self.aggregator)
        if self.uplink.get("kind") == "quant" and (self.secagg is not None or self.dp is not None):
            raise ConfigError(
                "compression.uplink_bits (a quantized uplink) cannot be combined with "
                f"{'[secagg]' if self.secagg is not None else '[dp]'}: each client quantizes "
                "with its own block scales, so payloads only add up once decoded one by one, "
                "which a secure sum (it sees only the total) and the DP noise calibrated on the "
                "payload sum cannot do; set compression.uplink_bits = 0 (rand-k or sketch "
                "uplink) or remove that table"
            )
        if self.dp is not None:
            _check_dp(self.dp, self.aggregator, self.secagg)
        if self.optimizer is not None and (self.rule.momentum or self.rule.lr != 1.0):
            raise ConfigError(
                "with a server optimizer, momentum and learning rate belong to it: leave "
                f"rule.momentum = 0 and rule.lr = 1 (got {self.rule.momentum}, {self.rule.lr}); "
                "e.g. optax.sgd(0.1, momentum=0.9)"
            )
        if self.rounds < 0:
            raise ConfigError(f"rounds must be >= 0, got {self.rounds}")
        if not 0 < self.fraction <= 1:
            raise ConfigError(
                f"fraction of clients per round must be in (0, 1], got {self.fraction}"
            )
        if not self.round_timeout > 0:
            raise ConfigError(f"round_timeout must be > 0 s, got {self.round_timeout}")
        if self.eval_every < 0:
            raise ConfigError(
                f"eval_every must be >= 0 (0 = only at the end), got {self.eval_every}"
            )


def _check_dp(dp: DPConfig, rule: Aggregator, secagg: SecAggConfig | None) -> None:
    """Refuse the combinations of differential privacy that cannot hold, naming why."""
    if not rule.linear:
        raise ConfigError(
            "[dp] needs the mean aggregation rule: the noise is calibrated to the sensitivity "
            "of a sum of clipped updates, which a median, trimmed mean, Krum or norm bound "
            "does not have; remove [aggregation] rule or [dp]"
        )
    if dp.mode == "distributed" and secagg is None:
        raise ConfigError(
            'dp.mode = "distributed" needs secure aggregation ([secagg]): without it the '
            "server sees each client's update with only its small noise share; add [secagg] "
            'or use dp.mode = "central"'
        )
    if dp.adaptive and secagg is not None:
        raise ConfigError(
            "dp.adaptive with secure aggregation is not supported: adaptive clipping needs the "
            "clients' clipped-or-not bits summed, and the secure sum carries the update only; "
            "use a fixed dp.clip, or turn secure aggregation off"
        )
    if secagg is not None and secagg.noise_std > 0:
        raise ConfigError(
            f"secagg.noise_std = {secagg.noise_std} and [dp] both add noise; set the noise "
            "through [dp] only (dp.noise_multiplier) and leave secagg.noise_std at 0"
        )


__all__ = ["FLConfig"]
