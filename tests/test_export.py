"""Stage export: safetensors + JSON description round trip, and refusals."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from tandem.engine.models import mlp_init
from tandem.parties.export import (
    ExportError,
    ExportMismatchError,
    describe,
    load_stages,
    read_description,
    save_stages,
)

TOPO = {"stages": {"bottom": {"party": "A"}, "top": {"party": "B", "inputs": ["bottom"]}}}


def stages():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {
        "bottom": mlp_init(k1, [5, 7, 3]),
        "extra": {
            "emb": (
                np.arange(6, dtype=np.int32).reshape(2, 3),
                np.array([1.5, -0.0, np.inf], ml_dtypes.bfloat16),
            ),
            "scale": np.float64(0.1) * np.ones((2,), np.float64),
        },
    }


def bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_round_trip_is_bit_exact(tmp_path):
    path = tmp_path / "A.safetensors"
    original = stages()
    desc = save_stages(path, original, topology=TOPO, party="A")
    loaded = load_stages(path, expect=describe(original, topology=TOPO, party="A"))
    assert loaded.description == desc == read_description(path)
    assert desc["stages"]["bottom"]["sizes"] == [5, 7, 3]
    assert desc["stages"]["bottom"]["dtype"] == "float32"
    assert desc["stages"]["extra"]["sizes"] is None and desc["stages"]["extra"]["dtype"] == "mixed"
    flat_o, tree_o = jax.tree_util.tree_flatten(original)
    flat_l, tree_l = jax.tree_util.tree_flatten(loaded.stages)
    assert tree_o == tree_l
    assert all(bits_equal(a, b) for a, b in zip(flat_o, flat_l, strict=True))
    # loaded params run through the model like the originals
    from tandem.engine.models import mlp_apply

    x = np.ones((2, 5), np.float32)
    assert bits_equal(mlp_apply(original["bottom"], x), mlp_apply(loaded.stages["bottom"], x))
    only = load_stages(path, stages=("bottom",))
    assert list(only.stages) == ["bottom"]


def test_scalar_parameters_keep_their_shape(tmp_path):
    """A 0-d parameter (a learned temperature, an Equinox scalar field) reloads as 0-d, so the
    model that trained it accepts the loaded parameters."""
    path = tmp_path / "A.safetensors"
    original = {"bottom": {"w": np.ones((2, 3), np.float32), "t": np.array(1.5, np.float32)}}
    desc = save_stages(path, original, topology=TOPO, party="A")
    assert desc["stages"]["bottom"]["tensors"]["bottom/t"]["shape"] == []
    loaded = load_stages(path).stages["bottom"]
    assert bits_equal(loaded["t"], original["bottom"]["t"])


def test_file_is_plain_safetensors_with_json_description(tmp_path):
    path = tmp_path / "A.safetensors"
    save_stages(path, stages(), topology=TOPO, party="A")
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    desc = json.loads(header["__metadata__"]["tandem"])
    assert desc["format"] == "tandem-stages" and desc["party"] == "A"
    assert header["bottom/0/w"]["dtype"] == "F32" and header["bottom/0/w"]["shape"] == [5, 7]
    assert b"pickle" not in raw and not raw.startswith(b"\x80")


@pytest.mark.parametrize(
    "expect,message",
    [
        ({"party": "B"}, "description.party does not match"),
        ({"topology": {"stages": {}}}, "topology in"),
        ({"stages": {"bottom": {"sizes": [5, 8, 3]}}}, r"description.stages.bottom.sizes"),
        ({"stages": {"bottom": {"dtype": "bfloat16"}}}, r"description.stages.bottom.dtype"),
        ({"stages": {"top": {"sizes": [3, 1]}}}, r"description.stages.top is expected"),
    ],
)
def test_mismatching_description_is_refused(tmp_path, expect, message):
    path = tmp_path / "A.safetensors"
    save_stages(path, stages(), topology=TOPO, party="A")
    with pytest.raises(ExportMismatchError, match=message):
        load_stages(path, expect=expect)


def test_corrupt_and_foreign_files_are_refused(tmp_path):
    path = tmp_path / "A.safetensors"
    save_stages(path, stages(), topology=TOPO, party="A")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01  # flip one bit of the last tensor
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ExportError, match="digest"):
        load_stages(bad)
    other = tmp_path / "other.safetensors"
    import safetensors.numpy

    safetensors.numpy.save_file({"x": np.zeros(2, np.float32)}, other)
    with pytest.raises(ExportError, match="not written by tandem.parties.export"):
        load_stages(other)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a file")
    with pytest.raises(ExportError, match="not a safetensors file"):
        load_stages(junk)
    with pytest.raises(ExportError, match="no stages file"):
        load_stages(tmp_path / "missing.safetensors")
    with pytest.raises(ExportMismatchError, match="stage 'top' is not in"):
        load_stages(path, stages=("top",))


def test_bad_inputs_are_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(ExportError, match="without '/'"):
        save_stages(path, {"a/b": [np.zeros(1)]}, topology={}, party="A")
    with pytest.raises(ExportError, match="only numeric arrays"):
        save_stages(path, {"a": [np.array(["s"])]}, topology={}, party="A")
    with pytest.raises(ExportError, match="JSON data"):
        save_stages(path, {"a": [np.zeros(1)]}, topology={"f": object()}, party="A")
    with pytest.raises(ExportError, match="no arrays"):
        save_stages(path, {"a": {}}, topology={}, party="A")
    assert not path.exists()


@settings(max_examples=examples(15), deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    dtype=st.sampled_from(["float32", "float16", "float64", "bfloat16"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_random_mlps(tmp_path_factory, sizes, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    params = [
        {"w": rng.standard_normal((a, b)).astype(dt), "b": rng.standard_normal(b).astype(dt)}
        for a, b in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    path = tmp_path_factory.mktemp("rt") / "p.safetensors"
    save_stages(path, {"s": params}, topology={"k": sizes}, party="P")
    loaded = load_stages(path, expect={"stages": {"s": {"sizes": sizes, "dtype": dtype}}})
    assert all(
        bits_equal(params[i][k], loaded.stages["s"][i][k])
        for i in range(len(params))
        for k in ("w", "b")
    )
