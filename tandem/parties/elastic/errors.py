"""Errors of the elastic roles. All derive from `tandem.errors.TandemError`."""

from __future__ import annotations

from tandem.errors import ConfigError, EngineError

__all__ = [
    "ElasticError",
    "StaleGenerationError",
    "LedgerError",
    "ConfigError",
    "ProtocolError",
    "NotWelcomedError",
    "CheckpointError",
    "DataServerDownError",
    "JournalError",
]


class ElasticError(EngineError):
    """Root of errors raised by the elastic coordinator, data servers and workers."""


class StaleGenerationError(ElasticError):
    """A result or request carries an older generation than the receiver's (fencing).

    It comes from a worker that was declared dead or whose batch was re-issued; the result is
    refused so that committed parameters hold every batch exactly once. Nothing to fix: the
    batch has been (or will be) issued again.
    """


class LedgerError(ElasticError):
    """The batch ledger was asked to do something that would break exactly-once bookkeeping
    (commit a batch twice, report an unknown batch id)."""


class ProtocolError(ElasticError, ValueError):
    """A frame between elastic roles is malformed (missing field, wrong shape or dtype)."""


class NotWelcomedError(ElasticError):
    """A worker heard no ``WELCOME`` from its coordinator within its ``join_timeout``: the
    coordinator is not running, not reachable at the configured address, has already finished,
    or does not admit this worker (one on no roster needs the coordinator's secret)."""


class CheckpointError(ElasticError):
    """A durable parameter-server checkpoint could not be written or read; the message names
    the location and the fix."""


class JournalError(ElasticError):
    """The coordinator's journal cannot be used: unreadable, or written by another run (other
    data servers, another model); the message names the file and the fix."""


class DataServerDownError(ElasticError):
    """A data server did not answer (killed, restarted, unreachable). The coordinator recovers:
    it waits for every data server and restores them all to the last committed checkpoint."""
