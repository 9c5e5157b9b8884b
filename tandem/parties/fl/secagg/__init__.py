"""Secure aggregation for federated rounds: the server learns only the sum of the clients'
(compressed) payloads. SecAgg (Bonawitz et al., CCS 2017: every client of a round shares with
every other) over X25519 / AES-GCM / Ed25519, Shamir sharing over GF(2**256 + 297), and a
fixed-point ring Z_2^32. Modules: `shamir`, `masking`, `crypto`, `messages`, `config`,
`client` (a client's stages), `server` (the server's stages and unmasking).
"""

from .config import SecAggConfig

__all__ = ["SecAggConfig"]
