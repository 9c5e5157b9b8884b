"""Every exception Tandem raises on purpose, in one place.

`TandemError` is the root: ``except tandem.TandemError`` catches whatever the library refuses
or fails at deliberately, and nothing else. Below it, one family per kind: `ConfigError` (a
setting or argument is wrong; the message names it, the accepted values and the fix),
`TransportError` (frames, peers, links), `EngineError` (topologies, plans, shapes). The
systems (`tandem.parties.*`) subclass these for their own kinds. This module imports nothing
of Tandem, so every layer may import it.
"""

from __future__ import annotations


class TandemError(Exception):
    """Root of all errors raised deliberately by Tandem."""


class ConfigError(TandemError, ValueError):
    """A configuration value is wrong; the message names it and the accepted values."""


class MissingExtraError(ConfigError):
    """A feature needs an optional dependency group (an *extra*) that is not installed.

    The message names the feature, the missing module and the command that installs the extra
    (``pip install 'tandem[EXTRA]'``). ``extra`` holds the extra's name.
    """

    def __init__(self, message: str, *, extra: str) -> None:
        super().__init__(message)
        self.extra = extra


class TransportError(TandemError):
    """Root of transport-layer errors."""


class LinkSetupError(TransportError):
    """A shaped test link (`tandem.transports.netns.NetnsLink`: namespaces, veth, tbf) could
    not be built: not root, no iproute2, or the kernel lacks what was asked (the caller may
    fall back)."""


class FrameError(TransportError, ValueError):
    """A frame could not be encoded or decoded, or does not match what was negotiated.

    The message names the field that was wrong and what was expected.
    """


class UnknownPeerError(TransportError, KeyError):
    """A frame was addressed to, or arrived from, a peer this transport does not know."""

    def __str__(self) -> str:  # KeyError would otherwise print the repr of the message
        return str(self.args[0]) if self.args else ""


class TransportClosedError(TransportError):
    """The transport (or the peer's side of it) was closed while an operation was pending."""


class PayloadTooLargeError(FrameError):
    """A frame exceeds the configured maximum size."""


class AdmissionError(FrameError):
    """A receiver's admission check refused a stream or a frame before accepting it (the
    party's plan or negotiated channels say it cannot be right); ``field`` names what was
    wrong (``"channel"``, ``"b"``, ``"m"``, ``"rows"``, ...)."""

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class AuthenticationError(TransportError):
    """A peer refused our credentials (HTTP 401), or an inbound request failed authentication.

    Both parties must share the same secret (and TLS trust roots), and their clocks must agree
    within the replay window.
    """


class IdentityError(AuthenticationError):
    """A valid signature of one roster member (per-party keys) on a request claiming to come
    from another party (HTTP 403 ``identity``): a party may sign only as itself."""


class PeerUnavailableError(TransportClosedError):
    """The peer could not be reached for longer than the retry deadline (connection lost,
    refused, or the peer is shutting down)."""


class PeersUnreachableError(TransportError):
    """A transport's ``wait_for_peers`` (`tandem.transports.base.PeerWaitingTransport`) ran
    out of time. ``pending`` maps each peer that is not ready to its address and the last
    problem seen (``"no answer"`` when none)."""

    def __init__(self, message: str, pending: dict[str, tuple[str, str]]) -> None:
        super().__init__(message)
        self.pending = dict(pending)


class UnknownTransportError(ConfigError):
    """No transport is registered for a URL's scheme (`tandem.transports.make_transport`);
    the message names the scheme and the registered ones."""


class EngineError(TandemError):
    """Root of the engine's errors (topologies, plans, scheduling, shapes)."""


class TopologyError(EngineError, ValueError):
    """A topology is malformed (cycle, missing owner or input, no loss stage, ...)."""


class PlanError(EngineError):
    """A plan violates an invariant (an op missing or duplicated, a dependency cycle)."""


class ShapeError(EngineError, ValueError):
    """A tensor's shape or dtype differs from what the stage or the task spec expects."""
