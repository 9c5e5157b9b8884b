"""Private sample alignment (ECDH-PSI) for split learning: see `psi.align` and docs/alignment.md.

`align` and `AlignedIds` load on first use: the PSI needs the ``psi`` extra. The aligned-rows
file it writes, which training and prediction read, is data: `tandem.parties.data.aligned_file`
(with the canonical ids and their commitment, `tandem.parties.data.canonical_ids`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    AlignmentConfigError,
    AlignmentError,
    AlignmentMismatchError,
    IdError,
    ProtocolError,
)

__all__ = [
    "AlignedIds",
    "AlignmentConfigError",
    "AlignmentError",
    "AlignmentMismatchError",
    "IdError",
    "ProtocolError",
    "align",
]


def __getattr__(name: str) -> Any:
    if name not in ("AlignedIds", "align"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import psi

    value = getattr(psi, name)
    globals()[name] = value  # the next access skips this function
    return value


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from .psi import AlignedIds, align
