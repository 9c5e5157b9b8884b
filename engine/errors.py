"""Exceptions of the engine. All derive from `transports.errors.TandemError`."""

from __future__ import annotations

from transports.errors import TandemError


class EngineError(TandemError):
    """Root of engine errors."""


class ConfigError(EngineError, ValueError):
    """A configuration value is wrong; the message names it and the accepted values."""


class TopologyError(EngineError, ValueError):
    """A topology is malformed (cycle, missing owner or input, no loss stage, ...)."""


class PlanError(EngineError):
    """A plan violates an invariant (an op missing or duplicated, a dependency cycle)."""


class ShapeError(EngineError, ValueError):
    """A tensor's shape or dtype differs from what the stage or the task spec expects."""
