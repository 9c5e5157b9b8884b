"""Exceptions of the transport layer.

`TandemError` is the root of every exception Tandem raises on purpose; it lives here, in the
lowest layer, so that `engine` and `parties` can subclass it without importing upwards.
"""

from __future__ import annotations


class TandemError(Exception):
    """Root of all errors raised deliberately by Tandem."""


class TransportError(TandemError):
    """Root of transport-layer errors."""


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


class AuthenticationError(TransportError):
    """A peer refused our credentials (HTTP 401), or an inbound request failed authentication.

    Both parties must share the same secret (and TLS trust roots), and their clocks must agree
    within the replay window.
    """


class PeerUnavailableError(TransportClosedError):
    """The peer could not be reached for longer than the retry deadline (connection lost,
    refused, or the peer is shutting down)."""
