"""The train/validation/test split: derived from the ids and a seed, the same on every party.

Each id gets ``u = uniform(id, seed)`` in [0, 1): the SplitMix64 finaliser of
``id_hashes(id) ^ splitmix64(seed)``, top 53 bits. An id goes to *test* when
``u < test``, to *validation* when ``test <= u < test + validation``, else to *train*. The
assignment depends on nothing but the id's text and the seed, so parties holding the same ids
in any order, or only some of them, put every shared id in the same part, and
the fractions hold in expectation (each id independently). This function is part of the
format: changing it changes which rows every party trains on (tests pin its values).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .config import SplitConfig
from .ids import id_hashes, splitmix64
from .idtext import IdText


@dataclasses.dataclass(frozen=True)
class Split:
    """Boolean masks over the rows, one per part. Invariant: every row is in exactly one."""

    train: np.ndarray
    validation: np.ndarray
    test: np.ndarray

    def rows(self, part: str) -> np.ndarray:
        """The (int64) positions of the rows in ``part`` ("train", "validation", "test")."""
        return np.flatnonzero(getattr(self, part))


def uniforms(
    ids: np.ndarray | IdText, seed: int, *, hashes: np.ndarray | None = None
) -> np.ndarray:
    """float64 in [0, 1) per id (an array of str, or an `IdText`), by the rule in the module
    docstring. ``hashes`` is ``id_hashes(ids)`` when the caller has it already."""
    hashes = id_hashes(ids) if hashes is None else hashes
    key = splitmix64(np.array([seed], np.uint64))
    return (splitmix64(hashes ^ key) >> np.uint64(11)) * (1.0 / (1 << 53))


def assign_split(
    ids: np.ndarray | IdText, config: SplitConfig, *, hashes: np.ndarray | None = None
) -> Split:
    """The split of ``ids`` under ``config`` (see the module docstring); ``hashes`` as in
    `uniforms`."""
    u = uniforms(ids, config.seed, hashes=hashes)
    test = u < config.test
    validation = ~test & (u < config.test + config.validation)
    return Split(train=~(test | validation), validation=validation, test=test)


__all__ = ["Split", "assign_split", "uniforms"]
