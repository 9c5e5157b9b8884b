"""Who shares with whom in a secure-aggregation round: SecAgg+'s sparse graph (Bell, Bonawitz,
Gascón, Lepoint, Raykova, "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead",
CCS 2020), or SecAgg's complete graph.

In SecAgg+ each client masks and shares its secrets with its ``k`` neighbours only, in a
Harary graph ``H(n, k)``: the round's clients are placed on a ring in a random order and each
is joined to the ``k / 2`` nearest on either side. The order is drawn from a hash of the
round's key list (names and public keys of every client that advertised), so the server and
every client compute the same graph and neither side picks it alone.

`harary_parameters` chooses ``k`` and the share threshold ``t`` (out of the ``k`` neighbours)
from the threat model, after Bell et al.'s analysis (Section 4 and Appendix): with at most a
share ``corrupt`` of the clients colluding with the server and at most a share ``dropout``
dropping out,

* the graph of honest surviving clients stays connected (else the server learns the sums of
  its parts) except with probability below ``2**-40``; a removed set that disconnects a Harary
  graph holds ``k / 2`` consecutive clients at two places on the ring, which bounds it;
* no client has ``t`` colluding neighbours (who could rebuild both its secrets) except with
  probability below ``2**-40`` over all clients, and, against a server that lies about who
  dropped (each honest neighbour returns one of the two secrets' shares, chosen from the list
  it was told), ``2 t - k`` exceeds the colluding neighbours as well;
* every client keeps ``t`` surviving neighbours (so the round completes) except with
  probability below ``2**-20``.

The smallest even ``k`` that meets all three is used; when none below ``n - 1`` does, the graph
is complete (SecAgg, Bonawitz et al. 2017, with its deterministic threshold).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence

SECURITY_BITS = 40
"""Statistical security: the chance that the server learns more than the sum is below 2**-40."""

CORRECTNESS_BITS = 20
"""The chance that a round with at most the configured drop-outs cannot finish: below 2**-20."""


@functools.lru_cache(maxsize=256)
def harary_parameters(n: int, corrupt: float, dropout: float) -> tuple[int, int] | None:
    """``(k, t)`` for a round of ``n`` clients: the smallest even degree that meets the
    guarantees above, or None when none below ``n - 1`` does (use the complete graph)."""
    for k in range(2, n - 1, 2):
        t = threshold_for(n, k, corrupt, dropout)
        if t is not None:
            return k, t
    return None


@functools.lru_cache(maxsize=256)
def threshold_for(n: int, k: int, corrupt: float, dropout: float) -> int | None:
    """The share threshold ``t`` (of ``k`` neighbours) that meets the guarantees above for
    degree ``k`` in a round of ``n`` clients, or None when no threshold does."""
    from scipy.stats import hypergeom

    bad_corrupt = math.floor(corrupt * n + 1e-12)
    survivors = math.ceil((1 - dropout) * n - 1e-12)
    if _log_disconnected(n, k, bad_corrupt + n - survivors) >= -(SECURITY_BITS + 1) * math.log(2):
        return None
    colluding = hypergeom(n, bad_corrupt, k)  # a client's colluding neighbours
    surviving = hypergeom(n, survivors, k)  # a client's surviving neighbours
    tail = 2.0 ** -(SECURITY_BITS + 1) / n
    t1 = next(t for t in range(k + 1) if colluding.sf(t) <= tail)
    t1 = math.ceil((t1 + k - 1.25) / 2)  # a server that lies about who dropped
    t2 = next(t for t in range(k + 1) if surviving.cdf(t) >= 2.0**-CORRECTNESS_BITS / n)
    return max(t1 + 1, 2) if t1 + 1 <= t2 else None


def _log_disconnected(n: int, k: int, bad: int) -> float:
    """A union bound (log) on the chance that removing ``bad`` random clients disconnects a
    random ``H(n, k)``: two runs of ``k / 2`` removed at two of the ring's places."""
    if k > bad:
        return -math.inf
    pairs = math.log(n) + math.log(n - k - 1) - math.log(2)
    return (
        pairs
        + math.lgamma(bad + 1)
        + math.lgamma(n - k + 1)
        - math.lgamma(n + 1)
        - math.lgamma(bad - k + 1)
    )


class Graph:
    """The sharing graph of one round over ``names`` (the key list, in order): ``holders(u)``
    are the clients that receive shares of ``u``'s secrets (its neighbours; in the complete
    graph every client, ``u`` included, as in SecAgg), and ``u`` masks with each neighbour.

    ``k`` is the degree (``len(names) - 1``: complete); ``seed`` fixes the ring's order."""

    def __init__(self, names: Sequence[str], k: int, seed: bytes) -> None:
        self.names = list(names)
        n = len(self.names)
        self.complete = k >= n - 1
        self.k = n - 1 if self.complete else k
        self._near: dict[str, list[str]] = {}  # filled as asked: a client needs its own only
        if not self.complete:
            self._ring = sorted(
                self.names, key=lambda u: hashlib.sha256(seed + u.encode()).digest()
            )
            self._at = {u: i for i, u in enumerate(self._ring)}

    def neighbours(self, u: str) -> list[str]:
        """The clients ``u`` masks with (sorted by name)."""
        near = self._near.get(u)
        if near is None:
            if self.complete:
                near = [v for v in self.names if v != u]
            else:
                at, n, half = self._at[u], len(self._ring), self.k // 2
                near = sorted(self._ring[(at + d) % n] for d in range(-half, half + 1) if d != 0)
            self._near[u] = near
        return near

    def holders(self, u: str) -> list[str]:
        """The clients holding shares of ``u``'s secrets, in the order of their commitments."""
        return self.names if self.complete else self.neighbours(u)


def graph_seed(
    label: bytes, names: Sequence[str], c_pk: Sequence[str], s_pk: Sequence[str]
) -> bytes:
    """The ring order's seed: a hash of the round's label and its whole key list."""
    h = hashlib.sha256(b"tandem secagg graph\n" + label)
    for row in zip(names, c_pk, s_pk, strict=True):
        h.update(b"\n" + "|".join(row).encode())
    return h.digest()


def check_degree(k: object, n: int) -> int:
    """``k`` as a degree for ``n`` clients (even, in ``[2, n - 1)``, or ``n - 1``: complete).
    Raises ValueError otherwise."""
    if not isinstance(k, int) or isinstance(k, bool):
        raise ValueError(f"the degree k must be an integer, got {k!r}")
    if k == n - 1 or (k % 2 == 0 and 2 <= k < n - 1):
        return k
    raise ValueError(f"the degree k={k} is neither even in [2, {n - 1}) nor {n - 1} (complete)")
