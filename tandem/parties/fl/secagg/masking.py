"""Fixed-point encoding in the ring Z_(2**32) and the masks of secure aggregation.

Encoding: a float payload ``p`` (clipped to ``[-bound, bound]`` per coordinate) becomes the
ring words ``round(p * scale) mod 2**32`` (uint32; negative values wrap, two's complement). The
sum of ``n`` such words, read back as int32 and divided by ``scale``, is the sum of the
payloads within ``n / (2 * scale)`` per coordinate, provided ``n * bound * scale < 2**31``:
then no partial sum leaves the int32 range, so overflow is impossible by construction
(`check_overflow` refuses a configuration that breaks it).

Masks: `prg` expands a 32-byte seed (hashed with a domain label that names the round and the
purpose) into uniform ring words: the AES-256-CTR keystream under that hash (``cryptography``,
AES-NI: tens of microseconds for 16K words). A client's masked input is

    y_u = encode(p_u) + PRG(b_u) + sum_{v != u} sign(u, v) * PRG(s_uv)   (mod 2**32)

with ``sign(u, v) = +1`` when ``u < v`` (by name) and ``-1`` otherwise, so the pairwise masks of
two clients that both contribute cancel in the sum, and each ``y_u`` alone is uniform.
"""

from __future__ import annotations

import hashlib

import numpy as np

from tandem.errors import ConfigError

MODULUS = 2**32
RING = np.uint32
HALF = 2**31


def check_overflow(n: int, bound: float, scale: float) -> None:
    """Refuse ``n`` clients' payloads bounded by ``bound`` at ``scale`` unless their sum fits
    in int32 (``n * bound * scale < 2**31``), naming the keys to change."""
    if not n * bound * scale < HALF:
        raise ConfigError(
            f"secure aggregation would overflow its ring Z_2^32: {n} clients x bound {bound} x "
            f"secagg.scale {scale} = {n * bound * scale:.4g} >= 2^31; lower secagg.scale or "
            "secagg.clip (or sample fewer clients per round)"
        )


def encode(payload: np.ndarray, bound: float, scale: float) -> np.ndarray:
    """``round(clip(payload, -bound, bound) * scale) mod 2**32`` as uint32 ring words."""
    x = np.clip(np.asarray(payload, np.float64), -bound, bound)
    return np.rint(x * scale).astype(np.int64).astype(RING)


def decode(words: np.ndarray, scale: float) -> np.ndarray:
    """Ring words read as int32 (two's complement) and divided by ``scale``: float32."""
    return (np.asarray(words, RING).view(np.int32).astype(np.float64) / scale).astype(np.float32)


def prg(seed: bytes, label: bytes, n: int) -> np.ndarray:
    """``n`` uniform uint32 words expanded from ``seed`` for purpose ``label`` (which must name
    the round, so no two rounds reuse a stream)."""
    from tandem._extras import needs

    with needs("keys", "secure aggregation ([secagg])"):
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key = hashlib.sha256(b"tandem secagg prg\n" + label + b"\n" + seed).digest()
    stream = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(stream.update(bytes(4 * n)), "<u4").astype(RING, copy=False)


def pair_sign(me: str, other: str) -> int:
    """+1 when ``me`` adds the pair's mask, -1 when it subtracts it (ordered by name)."""
    return 1 if me < other else -1


def mask(
    words: np.ndarray,
    self_seed: bytes,
    pair_seeds: dict[str, bytes],
    me: str,
    label: bytes,
) -> np.ndarray:
    """``words + PRG(self_seed) + sum_v sign(me, v) PRG(pair_seeds[v])`` (mod 2**32)."""
    out = np.asarray(words, RING) + prg(self_seed, label + b"|self", words.size).reshape(
        words.shape
    )
    for v, seed in pair_seeds.items():  # in place: `out` is this call's own array
        m = prg(seed, label + b"|pair", words.size).reshape(words.shape)
        (np.add if pair_sign(me, v) > 0 else np.subtract)(out, m, out=out)
    return out
