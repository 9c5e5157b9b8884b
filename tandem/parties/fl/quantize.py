"""Block quantization of a federated update, with the client's error feedback (pure numpy).

The uplink kind ``{"kind": "quant", "bits": b, "block": B}`` sends every coordinate at ``b``
bits (2, 4 or 8) instead of 32: the vector is cut into blocks of ``B`` coordinates; each block
travels as its largest magnitude ``s`` (float32) and one code per coordinate, the nearest of the
``2L + 1`` levels ``s * q / L`` (``q`` in ``[-L, L]``, ``L = 2**(b-1) - 1``: 1, 7 or 127),
stored as ``q + L`` in ``b`` bits, ``8 // b`` codes per byte (lowest bits first). Cost per
coordinate: ``b + 32 / B`` bits (4 bits at ``B = 256``: 7.8x fewer bytes than float32).

Rounding to the nearest level is biased; **error feedback** (`quantize_feedback`, EF-SGD:
Stich et al. 2018, Karimireddy et al. 2019) removes the bias over rounds: the client adds what
it did not send last round (``residual``) to its next update, so ``sent + new_residual == delta
+ residual`` (up to float32 rounding) and nothing is lost, only delayed. The residual costs the
client ``d`` float32 (4 bytes per parameter).

Wire layout of a payload (one uint8 array, `payload_size` bytes): the ``ceil(d / B)`` block
scales as little-endian float32, then the packed codes (``ceil(d * b / 8)`` bytes).
"""

from __future__ import annotations

import math

import numpy as np

from tandem.errors import ConfigError

QUANT_BITS = (2, 4, 8)
"""Bit widths a quantized uplink supports (a byte holds a whole number of codes)."""


def check_quant(bits: object, block: object) -> None:
    """Raise `ConfigError` unless ``bits`` is one of `QUANT_BITS` and ``block`` an int >= 1."""
    if bits not in QUANT_BITS or isinstance(bits, bool):
        raise ConfigError(f"quantized uplink bits must be one of {QUANT_BITS}, got {bits!r}")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ConfigError(f"quantized uplink block must be an integer >= 1, got {block!r}")


def levels(bits: int) -> int:
    """``L``: codes stand for ``q / L`` of the block scale, ``q`` in ``[-L, L]``."""
    return 2 ** (bits - 1) - 1


def payload_size(d: int, bits: int, block: int) -> int:
    """Bytes of a payload for a ``d``-vector: ``4 * ceil(d / block) + ceil(d * bits / 8)``."""
    return 4 * math.ceil(d / block) + math.ceil(d * bits / 8)


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    d = x.shape[0]
    return np.pad(x, (0, (-d) % block)).reshape(-1, block)


def quantize(x, bits: int, block: int) -> np.ndarray:
    """The uint8 payload of ``x`` (float32, 1-d): block scales, then packed codes."""
    check_quant(bits, block)
    x = np.asarray(x, np.float32)
    lv = levels(bits)
    b = _blocks(x, block)
    scale = np.abs(b).max(axis=1).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    q = np.rint(b / safe[:, None] * lv).astype(np.int16)
    codes = (np.clip(q, -lv, lv) + lv).astype(np.uint8).reshape(-1)[: x.shape[0]]
    per = 8 // bits
    codes = np.pad(codes, (0, (-codes.shape[0]) % per)).reshape(-1, per)
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    packed = np.bitwise_or.reduce(codes << shifts, axis=1).astype(np.uint8)
    return np.concatenate([scale.astype("<f4").view(np.uint8), packed])


def split_payload(payload, d: int, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """``(scales float32 (ceil(d/block),), codes uint8 (d,))`` of a payload of the right size
    (`payload_size`; the caller checks it)."""
    payload = np.asarray(payload, np.uint8)
    nb = math.ceil(d / block)
    scales = payload[: 4 * nb].view("<f4").astype(np.float32)
    per = 8 // bits
    packed = payload[4 * nb :]
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    mask = np.uint8((1 << bits) - 1)
    codes = ((packed[:, None] >> shifts) & mask).reshape(-1)[:d]
    return scales, codes


def dequantize(payload, d: int, bits: int, block: int) -> np.ndarray:
    """The float32 ``(d,)`` vector a payload stands for (codes above ``2L`` are clipped; the
    server refuses such payloads first: `tandem.parties.fl.protocol.check_update`)."""
    check_quant(bits, block)
    scales, codes = split_payload(payload, d, bits, block)
    lv = levels(bits)
    q = np.minimum(codes.astype(np.float32), 2 * lv) - lv
    q = np.pad(q, (0, (-d) % block)).reshape(-1, block)
    return (q * (scales[:, None] / np.float32(lv))).reshape(-1)[:d].astype(np.float32)


def quantize_feedback(
    delta, residual: np.ndarray | None, bits: int, block: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(payload, new_residual)`` for ``acc = delta + residual`` (None: zeros).

    Invariant: ``dequantize(payload) + new_residual == acc`` up to float32 rounding of the
    subtraction, so no part of an update is dropped, only delayed to a later round."""
    acc = np.asarray(delta, np.float32)
    if residual is not None:
        if residual.shape != acc.shape:
            raise ConfigError(f"residual {residual.shape} and update {acc.shape} differ")
        acc = acc + residual
    payload = quantize(acc, bits, block)
    return payload, acc - dequantize(payload, acc.shape[0], bits, block)


__all__ = [
    "QUANT_BITS",
    "check_quant",
    "dequantize",
    "levels",
    "payload_size",
    "quantize",
    "quantize_feedback",
    "split_payload",
]
