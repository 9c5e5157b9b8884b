"""The split by id and seed: the same on every party, whatever the row order."""

import numpy as np
import pytest

from tandem.parties.data import SplitConfig, assign_split, uniforms
from tandem.parties.data.ids import first_duplicate, id_hashes

MASK = (1 << 64) - 1


def splitmix64_reference(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def uniform_reference(identifier: str, seed: int) -> float:
    """The rule of tandem.parties.data.ids and .split, one id at a time in Python integers."""
    data = identifier.encode("utf-8")
    polynomial = sum((b + 1) * pow(0x100000001B3, i, 1 << 64) for i, b in enumerate(data)) & MASK
    h = splitmix64_reference(polynomial ^ splitmix64_reference(len(data)))
    return (splitmix64_reference(h ^ splitmix64_reference(seed)) >> 11) / (1 << 53)


def ids_array(values):
    return np.array(list(values), dtype=object)


def test_uniforms_follow_the_documented_rule():
    rng = np.random.default_rng(0)
    alphabet = list("abcXYZ019-_ éü漢🙂")
    ids = ["", "a", "42", "007"] + [
        "".join(rng.choice(alphabet, size=rng.integers(1, 40))) for _ in range(200)
    ]
    for seed in (0, 7, 2**64 - 1):
        expected = [uniform_reference(i, seed) for i in ids]
        assert uniforms(ids_array(ids), seed).tolist() == expected


def test_uniforms_are_pinned():
    # Parties running different Tandem versions must agree: these values are part of the format.
    ids = ids_array(["a", "42", "", "é", "customer-000017"])
    assert uniforms(ids, 7).tolist() == [
        0.890914435782964,
        0.8355611729876091,
        0.8612315908783932,
        0.9096002341760664,
        0.28298971367173176,
    ]


def test_hashes_do_not_depend_on_the_chunking():
    ids = ids_array(f"id-{i}" for i in range(300_000))  # more than one chunk
    whole = id_hashes(ids)
    np.testing.assert_array_equal(whole[-5:], id_hashes(ids[-5:]))
    np.testing.assert_array_equal(whole[:5], id_hashes(ids[:5]))


def test_two_parties_with_the_ids_in_another_order_agree():
    ids = ids_array(f"customer-{i:06d}" for i in range(20_000))
    order = np.random.default_rng(1).permutation(len(ids))
    config = SplitConfig(test=0.2, validation=0.1, seed=11)
    a, b = assign_split(ids, config), assign_split(ids[order], config)
    for part in ("train", "validation", "test"):
        assert set(ids[getattr(a, part)]) == set(ids[order][getattr(b, part)])


def test_a_party_with_only_some_of_the_ids_agrees_on_those():
    ids = ids_array(str(i) for i in range(10_000))
    config = SplitConfig(test=0.3, seed=5)
    full = assign_split(ids, config)
    some = np.arange(0, 10_000, 3)
    part = assign_split(ids[some], config)
    np.testing.assert_array_equal(part.test, full.test[some])
    np.testing.assert_array_equal(part.train, full.train[some])


def test_every_row_is_in_exactly_one_part_and_the_fractions_hold():
    ids = ids_array(str(i) for i in range(100_000))
    s = assign_split(ids, SplitConfig(test=0.2, validation=0.1, seed=3))
    total = s.train.astype(int) + s.validation + s.test
    assert (total == 1).all()
    assert s.test.mean() == pytest.approx(0.2, abs=0.01)
    assert s.validation.mean() == pytest.approx(0.1, abs=0.01)
    np.testing.assert_array_equal(s.rows("test"), np.flatnonzero(s.test))


def test_the_seed_changes_the_split():
    ids = ids_array(str(i) for i in range(1000))
    a = assign_split(ids, SplitConfig(seed=1)).test
    b = assign_split(ids, SplitConfig(seed=2)).test
    assert (a != b).any()
    assert not assign_split(ids, SplitConfig(test=0.0)).test.any()


def test_first_duplicate():
    assert first_duplicate(ids_array(["a", "b", "c"])) is None
    assert first_duplicate(ids_array(["a", "b", "c", "b"])) == ("b", 1, 3)
