"""What a federated party builds from its checked configuration: the optax optimizer.

Kept apart from `tandem.parties.fl.config` (which only checks and holds values); the checker
calls `build_optimizer` once to refuse a name or an argument optax does not take.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

from tandem.errors import ConfigError


def build_optimizer(
    name: str, kwargs: Mapping[str, Any], where: str = "[optimizer]"
) -> optax.GradientTransformation:
    """``optax.<name>(**kwargs)``; a `ConfigError` (worded for ``where``) when ``name`` is not
    an optax optimizer or does not take these arguments."""
    fn = getattr(optax, name, None) if not name.startswith("_") else None
    if fn is None or not callable(fn) or isinstance(fn, type):
        raise ConfigError(
            f"{where} name = {name!r} is not an optax optimizer; use one of optax's, e.g. "
            '"sgd" (FedAvg with learning_rate = 1), "adam" (FedAdam), "yogi" (FedYogi), '
            '"adagrad", "rmsprop", "lamb"'
        )
    try:
        opt = fn(**dict(kwargs))
    except TypeError as exc:
        raise ConfigError(
            f"{where} optax.{name} does not take these arguments {sorted(kwargs)}: {exc}; "
            f"the table's other keys are optax.{name}'s keyword arguments"
        ) from None
    if not isinstance(opt, optax.GradientTransformation):
        raise ConfigError(
            f"{where} optax.{name}(...) returned {type(opt).__name__}, not an optimizer"
        )
    return opt


__all__ = ["build_optimizer"]
