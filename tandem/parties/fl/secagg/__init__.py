"""Secure aggregation for federated rounds: the server learns only the sum of the clients'
(compressed) payloads. SecAgg+ (Bell et al., CCS 2020: each client shares with its neighbours
in a sparse graph) over SecAgg's stages (Bonawitz et al., CCS 2017), X25519 / AES-GCM /
Ed25519, Shamir sharing over GF(2**256 + 297), and a fixed-point ring Z_2^32. Modules:
`shamir`, `masking`, `crypto`, `messages`, `graph` (who shares with whom), `config`, `client`
(a client's stages), `server` (the server's stages and unmasking).
"""

from .config import SecAggConfig

__all__ = ["SecAggConfig"]
