"""Private sample alignment (ECDH-PSI) for split learning: see `psi.align` and docs/alignment.md."""

from .errors import (
    AlignmentConfigError,
    AlignmentError,
    AlignmentMismatchError,
    IdError,
    ProtocolError,
)
from .psi import AlignedIds, align

__all__ = [
    "AlignedIds",
    "AlignmentConfigError",
    "AlignmentError",
    "AlignmentMismatchError",
    "IdError",
    "ProtocolError",
    "align",
]
