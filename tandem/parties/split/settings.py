"""The settings every party of a split-learning job agrees on (`SplitConfig`), the optimizers
they name, and what `SplitParty.fit` returns per epoch (`EpochResult`).

`tandem.parties.split.hyper` declares these fields once as the ``[train]`` TOML keys; the task
spec hashes them, so the parties refuse to train on different settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from tandem.engine.kernels import get_loss
from tandem.engine.policy import Backpressure, as_policy
from tandem.errors import ConfigError

from .compress import CutCompressor
from .hyper import SPLIT_FIELDS, Train
from .metrics import Metric

#: `SplitConfig`'s defaults, read from the one declaration of the split hyper-parameters
_DEFAULT: dict[str, Any] = {k: Train.model_fields[k].default for k in SPLIT_FIELDS}


@dataclasses.dataclass
class SplitConfig:
    """Training settings every party must agree on (the leader's are authoritative for n).

    ``groups``: an int ``n`` (fixed), or ``"auto"`` (tuned between batches).
    ``chunks``: messages per group each way (`tandem.engine.plan`): the loss party computes per
    message, so a group's gradient starts back after its first part instead of after the whole
    group. Lowered to the smallest group's rows. ``threshold`` and ``capacity`` count groups'
    worth of messages (a party queues up to ``capacity * chunks`` frames). ``policy``: the name
    of a built-in scheduling policy (`tandem.engine.policy.POLICIES`), which the task spec
    records; each batch runs with the policy named when it starts. ``compress``: how cut
    messages travel (`tandem.parties.split.compress.KINDS`; ``"none"``, the default, trains
    exactly), ``compress_topk`` the share of each row ``"topk"`` sends; the task spec records
    both, and every party must use the leader's. (The ``[privacy]`` defenses, also in the
    spec, are `SplitParty`'s ``privacy`` argument: a section of their own.)
    """

    # the fields of [train] whose role is "split" (`hyper.Train`, the one declaration: their
    # order and defaults come from it; the types are restated here for the type checker)
    batch_size: int = _DEFAULT["batch_size"]
    epochs: int = _DEFAULT["epochs"]
    groups: int | str = _DEFAULT["groups"]
    chunks: int = _DEFAULT["chunks"]
    learning_rate: float = _DEFAULT["learning_rate"]
    optimizer: str = _DEFAULT["optimizer"]
    loss: str = _DEFAULT["loss"]
    seed: int = _DEFAULT["seed"]
    threshold: int = _DEFAULT["threshold"]
    capacity: int = _DEFAULT["capacity"]
    policy: str = _DEFAULT["policy"]
    compress: str = _DEFAULT["compress"]
    compress_topk: float = _DEFAULT["compress_topk"]

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if not (self.groups == "auto" or (isinstance(self.groups, int) and self.groups >= 1)):
            raise ConfigError(f"groups must be a positive int or 'auto', got {self.groups!r}")
        if not (isinstance(self.chunks, int) and self.chunks >= 1):
            raise ConfigError(f"chunks must be a positive int, got {self.chunks!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"unknown optimizer {self.optimizer!r}; choose one of {sorted(OPTIMIZERS)}"
            )
        if not self.learning_rate > 0:
            raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate}")
        get_loss(self.loss)
        Backpressure(self.threshold, self.capacity)
        as_policy(self.policy)
        self.compressor  # noqa: B018 - checks compress and compress_topk now

    @property
    def compressor(self) -> CutCompressor:
        """The cut-layer compressor ``compress`` and ``compress_topk`` name."""
        return CutCompressor(self.compress, self.compress_topk)

    def make_optimizer(self) -> optax.GradientTransformation:
        return OPTIMIZERS[self.optimizer](self.learning_rate)

    @property
    def backpressure(self) -> Backpressure:
        return Backpressure(self.threshold, self.capacity)


if tuple(f.name for f in dataclasses.fields(SplitConfig)) != SPLIT_FIELDS:  # pragma: no cover
    raise ImportError(
        "SplitConfig's fields differ from the split fields of hyper.Train; declare a split "
        "hyper-parameter in hyper.Train and restate it in SplitConfig, in the same order"
    )

OPTIMIZERS: dict[str, Callable[[float], optax.GradientTransformation]] = {
    "adam": optax.adam,
    "sgd": optax.sgd,
    "adamw": optax.adamw,
    "momentum": lambda lr: optax.sgd(lr, 0.9),
}

#: optimizers whose state cannot be float16: Adam's epsilon (1e-8) rounds to 0 there, so a zero
#: gradient (a dead ReLU, a padded row) makes the update 0 / 0 and the parameters NaN
_NO_FLOAT16 = ("adam", "adamw")


def check_param_dtypes(optimizer: str, params: Mapping[str, Any]) -> None:
    """`ConfigError` naming the stage when the optimizer ``optimizer`` names cannot train its
    parameters (``params``: stage -> pytree): float16 parameters under Adam."""
    if optimizer not in _NO_FLOAT16:
        return
    for stage, tree in params.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if getattr(leaf, "dtype", None) == jnp.float16:
                raise ConfigError(
                    f"stage {stage!r}: parameter {jax.tree_util.keystr(path)} is float16, "
                    f"which optimizer {optimizer!r} turns into NaN (its epsilon rounds to 0 "
                    "in float16, so a zero gradient gives 0 / 0); keep the parameters float32 "
                    "or bfloat16 (cast to float16 inside apply for a float16 cut), or use "
                    "optimizer 'sgd' or 'momentum'"
                )


@dataclasses.dataclass
class EpochResult:
    """One epoch of `SplitParty.fit`: its mean training loss per row, its training seconds, the
    micro-batch count at its end, its batches, the metrics of a validation run after it
    (filled by an ``after_epoch`` hook, e.g. `tandem.parties.split.reporting.Reporter`) and
    its privacy keys. ``loss`` is NaN where no batch of the epoch ran in this call (a resume
    at the epoch's end, to run its ``after_epoch`` hook)."""

    epoch: int
    loss: float
    seconds: float
    n_groups: int
    batches: int
    validation: dict[str, Metric] = dataclasses.field(default_factory=dict)
    #: what the epoch spent or revealed of the privacy ([privacy]): history keys and values,
    #: e.g. ``privacy_epsilon`` (`tandem.parties.privacy.accounting.epoch_report`)
    privacy: dict[str, float] = dataclasses.field(default_factory=dict)


__all__ = ["OPTIMIZERS", "EpochResult", "SplitConfig"]
