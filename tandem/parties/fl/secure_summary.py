"""The numeric part of a data summary as secure-aggregation input, and back (pure).

Under secure aggregation (``[secagg]`` on the server) the clients' numeric summaries (per
numeric column: present cells, missing cells, sum, sum of squares; `tandem.parties.data.summary`)
go through the same secure sum as the model updates (`tandem.parties.fl.secagg`), so the
server learns only their totals over the round's surviving clients, never one client's.

Encoding (exact integer sums): each of the ``4 * columns`` quantities ``q`` becomes the
integer ``round(q * 2**FRACTION_BITS)`` taken modulo ``2**MODULUS_BITS`` (two's complement),
cut into `LIMBS` limbs of `LIMB_BITS` bits, each limb one word of the secure sum's ring
Z_2^32 (fixed-point scale 1: the limb travels as itself). The server sums the limbs of up to
``n < 2**15`` clients (the ring check of `SecAggConfig` refuses more), so no limb sum wraps;
it recombines ``sum_l S_l * 2**(16 l)`` modulo ``2**MODULUS_BITS``, reads it as signed and
divides by ``2**FRACTION_BITS``. The result is each total to ``n * 2**-33`` (the per-client
rounding), counts exactly.

Overflow is impossible by construction within the stated bounds: a client refuses a value
with ``|x| > preprocessing.max_abs`` (naming the key and the column) and more than `MAX_ROWS`
training rows, and the server refuses a ``max_abs`` for which ``clients * MAX_ROWS *
max_abs**2 * 2**FRACTION_BITS`` reaches ``2**(MODULUS_BITS - 1)`` (`check_bound`).

Categorical columns add nothing to the secure sum: a hashed column (``[data] hash_buckets``)
needs no statistic and a declared vocabulary (``data.vocabularies``) none either; per-client
value counts go in the clear only when the server's ``preprocessing.reveal_categories`` says
so (`public_part`), since a vocabulary names values and the counts say how many rows hold them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tandem.errors import ConfigError
from tandem.parties.data import DataError

FRACTION_BITS = 32
LIMB_BITS = 16
LIMBS = 12
MODULUS_BITS = LIMB_BITS * LIMBS  # 192
MAX_ROWS = 2**40
#: Largest ``preprocessing.max_abs`` accepted (the bound is also checked per client count).
MAX_ABS_LIMIT = 2.0**52
QUANTITIES = ("present", "missing", "sum", "sumsq")
#: The party name under which the secure totals enter `tandem.parties.data.summary.merge`.
TOTALS = "secure sum"


def check_bound(max_abs: float, clients: int) -> None:
    """Refuse a ``max_abs`` whose totals over ``clients`` could leave the ring (module
    docstring), naming ``preprocessing.max_abs``."""
    top = clients * MAX_ROWS * max_abs * max_abs * 2.0**FRACTION_BITS
    if not (0 < max_abs <= MAX_ABS_LIMIT and top < 2.0 ** (MODULUS_BITS - 1)):
        raise ConfigError(
            f"preprocessing.max_abs = {max_abs:g} with {clients} clients could overflow the "
            f"secure sum of the data summaries (ring Z_2^{MODULUS_BITS}, scale "
            f"2^{FRACTION_BITS}, up to 2^40 rows per client); lower it (it bounds |value| of "
            "every numeric feature) or rescale the features"
        )


def encode(summary: Mapping[str, Any], max_abs: float, where: str) -> np.ndarray:
    """The limbs (float64 whole numbers in ``[0, 2**16)``, ``(4 * columns * LIMBS,)``) of a
    client's numeric summary. Refuses (`DataError` naming ``where``, the column and the key) a
    value beyond ``max_abs`` and more than `MAX_ROWS` rows."""
    words: list[int] = []
    for c in summary["numeric"]:
        if float(c.get("peak", 0.0)) > max_abs:
            raise DataError(
                f"{where}: numeric column {c['name']!r} holds a value of magnitude "
                f"{float(c['peak']):g}, beyond the server's preprocessing.max_abs = {max_abs:g} "
                "(the bound that keeps the secure sum of the data summaries from overflowing); "
                "rescale the column, or raise preprocessing.max_abs on the server"
            )
        if int(c["present"]) + int(c["missing"]) > MAX_ROWS:
            raise DataError(f"{where}: more than 2^40 training rows cannot be summed securely")
        for q in QUANTITIES:
            fixed = round(float(c[q]) * 2.0**FRACTION_BITS) % 2**MODULUS_BITS
            words += [(fixed >> (LIMB_BITS * k)) & 0xFFFF for k in range(LIMBS)]
    return np.asarray(words, np.float64)


def decode(words: np.ndarray, names: Sequence[str]) -> list[dict[str, Any]]:
    """The numeric totals of the columns ``names`` from the summed limbs ``words`` (uint32
    ring words, one limb sum each; see the module docstring)."""
    if words.shape != (len(names) * len(QUANTITIES) * LIMBS,):
        raise DataError(f"the secure sum of the summaries has shape {words.shape}")
    limbs = [int(w) for w in np.asarray(words, np.uint32)]
    out = []
    for j, name in enumerate(names):
        entry: dict[str, Any] = {"name": name}
        for i, q in enumerate(QUANTITIES):
            at = (j * len(QUANTITIES) + i) * LIMBS
            total = sum(w << (LIMB_BITS * k) for k, w in enumerate(limbs[at : at + LIMBS]))
            total %= 2**MODULUS_BITS
            if total >= 2 ** (MODULUS_BITS - 1):
                total -= 2**MODULUS_BITS
            value = total / 2**FRACTION_BITS
            entry[q] = round(value) if q in ("present", "missing") else value
        out.append(entry)
    return out


def public_part(summary: Mapping[str, Any], reveal: bool) -> dict[str, Any]:
    """What a client sends in the clear beside the secure sum: its columns and their kinds,
    and its categorical value counts only when ``reveal`` (no sum, no row count, no peak)."""
    return {
        "format": summary["format"],
        "numeric": [{"name": c["name"]} for c in summary["numeric"]],
        "categorical": [
            {
                "name": c["name"],
                "kind": c["kind"],
                "values": list(c["values"]) if reveal else [],
                "counts": list(c["counts"]) if reveal else [],
            }
            for c in summary["categorical"]
        ],
    }


def clear_part(summary: Mapping[str, Any]) -> dict[str, Any]:
    """What a client sends without secure aggregation: its whole summary but the peaks."""
    numeric = [{k: v for k, v in c.items() if k != "peak"} for c in summary["numeric"]]
    return {**summary, "numeric": numeric}


def for_merge(
    public: Mapping[str, Mapping[str, Any]], totals: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The summaries `tandem.parties.data.summary.merge` takes: each client's public part
    (with zero numeric sums) and the secure totals under the party name `TOTALS`."""
    zero = dict.fromkeys(QUANTITIES, 0)
    out: dict[str, dict[str, Any]] = {}
    for party, s in public.items():
        numeric = [{"name": c["name"], **zero} for c in s["numeric"]]
        out[party] = {**s, "numeric": numeric}
    first = next(iter(public.values()))
    categorical = [
        {"name": c["name"], "kind": c["kind"], "values": [], "counts": []}
        for c in first["categorical"]
    ]
    out[TOTALS] = {"format": first["format"], "numeric": totals, "categorical": categorical}
    return out


def words_needed(columns: int) -> int:
    """Ring words of the secure sum for ``columns`` numeric columns."""
    return columns * len(QUANTITIES) * LIMBS


def max_abs_ok(value: Any) -> float:
    """``value`` as a usable ``max_abs`` from a request (`DataError` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DataError(f"the server's summary request has max_abs {value!r}, not a number")
    if not (math.isfinite(value) and 0 < value <= MAX_ABS_LIMIT):
        raise DataError(f"the server's summary request has max_abs {value!r} out of range")
    return float(value)


__all__ = [
    "FRACTION_BITS",
    "LIMBS",
    "LIMB_BITS",
    "MAX_ROWS",
    "MODULUS_BITS",
    "TOTALS",
    "check_bound",
    "clear_part",
    "decode",
    "encode",
    "for_merge",
    "max_abs_ok",
    "public_part",
    "words_needed",
]
