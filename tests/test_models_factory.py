"""User factories by import path (`load_factory`), specs (`model_from_spec`) and per-stage TOML
tables (`model_from_toml`): what they build, and the refusals that name the fix."""

from __future__ import annotations

import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tandem.engine import kernels
from tandem.errors import ConfigError
from tandem.parties.models import load_factory, mlp, model_from_spec, model_from_toml

FIXTURE = "tests.models_fixture"


def test_factory_spec_records_reference_and_json_kwargs():
    model = load_factory(
        f"{FIXTURE}:embedding_bottom", {"n_dense": 2, "vocab": (5, 3), "dim": 4, "out": 6}
    )
    assert model.spec == {
        "kind": "factory",
        "factory": f"{FIXTURE}:embedding_bottom",
        "kwargs": {"n_dense": 2, "vocab": [5, 3], "dim": 4, "out": 6},
    }
    assert model.in_dims == (4,) and model.out_dim == 6
    rebuilt = model_from_spec(model.spec)
    params = model.init(jax.random.PRNGKey(0))
    x = jnp.array([[0.1, 0.2, 1, 2]], jnp.float32)
    np.testing.assert_array_equal(rebuilt.apply(params, x), model.apply(params, x))


@pytest.mark.parametrize(
    "reference, kwargs, match",
    [
        (
            "tests/models_fixture.py",
            {},
            "not an import reference; write it as 'package.module:function'",
        ),
        ("tests.models_fixture", {}, "not an import reference"),
        ("no_such_pkg_xyz.models:bottom", {}, "cannot import 'no_such_pkg_xyz.models'"),
        (f"{FIXTURE}:nope", {}, "has no attribute 'nope'; it defines .*functions_bottom"),
        (f"{FIXTURE}:WIDTH", {}, "is a int, not callable"),
        (f"{FIXTURE}:not_a_model", {}, "returned a dict, not a StageModel"),
        (f"{FIXTURE}:raises", {"width": 3}, "raised RuntimeError: cannot build width 3"),
        (f"{FIXTURE}:functions_bottom", {"in_dim": 3}, "raised TypeError"),
        (f"{FIXTURE}:functions_bottom", {"in_dim": np.ones(3)}, "ndarray, not JSON data"),
        (
            f"{FIXTURE}:functions_bottom",
            {"in_dim": 3, "out": 2, "scale": float("nan")},
            "only finite",
        ),
        (
            f"{FIXTURE}:functions_bottom",
            {"in_dim": {1: 2}},
            "needs str keys|JSON tables need str keys",
        ),
        (f"{FIXTURE}:functions_bottom", [1, 2], "must be a table of keyword arguments"),
    ],
)
def test_factory_refusals_name_the_reference_and_fix(reference, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        load_factory(reference, kwargs)


def test_numpy_scalars_are_json_numbers():
    model = load_factory(
        f"{FIXTURE}:functions_bottom", {"in_dim": np.int64(3), "out": 2, "scale": np.float32(0.5)}
    )
    assert model.spec["kwargs"] == {"in_dim": 3, "out": 2, "scale": 0.5}
    assert type(model.spec["kwargs"]["in_dim"]) is int


def test_spec_kinds_and_unknown_kind():
    for spec in (
        {"kind": "mlp", "in_dims": [3], "hidden": [4], "out_dim": 2, "activate_last": True},
        {
            "kind": "embedding",
            "n_dense": 1,
            "vocab": [3],
            "dim": 2,
            "hidden": [],
            "out_dim": 2,
            "activate_last": False,
        },
        {
            "kind": "factory",
            "factory": f"{FIXTURE}:functions_bottom",
            "kwargs": {"in_dim": 3, "out": 2},
        },
    ):
        model = model_from_spec(spec)
        assert model.spec == spec
    with pytest.raises(
        ConfigError,
        match="model kind 'conv' is unknown; this Tandem builds .*'embedding'.*'factory'.*'mlp'",
    ):
        model_from_spec({"kind": "conv"})
    with pytest.raises(ConfigError, match="malformed"):
        model_from_spec({"kind": "embedding", "vocab": [3]})


def test_register_model_kind_refuses_a_second_builder():
    kernels.register_model_kind("mlp", kernels.mlp_stage)  # the same builder: no-op
    with pytest.raises(ConfigError, match="already registered"):
        kernels.register_model_kind("mlp", mlp)


# -- TOML ----------------------------------------------------------------------------------------
def stages(text: str) -> dict:
    return tomllib.loads(text)["model"]


TOML = """
[model.bottom_leader]
kind = "mlp"
hidden = [64, 32]
out = 16

[model.bottom_follower]
kind = "embedding"
dim = 8
hidden = [32]
out = 16

[model.bottom_extra]
factory = "tests.models_fixture:functions_bottom"
kwargs = { in_dim = 4, out = 16, scale = 0.5 }

[model.top]
kind = "mlp"
hidden = [8]
"""


def test_toml_forms():
    t = stages(TOML)
    leader = model_from_toml(t["bottom_leader"], in_dims=[10], where="model.bottom_leader")
    assert leader.spec == {
        "kind": "mlp",
        "in_dims": [10],
        "hidden": [64, 32],
        "out_dim": 16,
        "activate_last": True,
    }
    follower = model_from_toml(t["bottom_follower"], in_dims=[7], vocab=[12, 4])
    assert follower.spec["kind"] == "embedding"
    assert follower.spec["n_dense"] == 5 and follower.spec["vocab"] == [12, 4]
    assert follower.spec["dim"] == 8 and follower.out_dim == 16
    extra = model_from_toml(t["bottom_extra"], in_dims=[4])
    assert extra.spec["kwargs"] == {"in_dim": 4, "out": 16, "scale": 0.5}
    top = model_from_toml(t["top"], in_dims=[16, 16, 16], out_dim=1, loss=True)
    assert top.out_dim == 1 and top.spec["activate_last"] is False
    for m in (leader, follower, extra, top):
        assert model_from_spec(m.spec).in_dims == m.in_dims


@pytest.mark.parametrize(
    "table, kwargs, match",
    [
        (
            {"kind": "mlp", "hidden": [4], "out": 2, "width": 3},
            {},
            r"\[model.s\] has unknown keys \['width'\]; a 'mlp' model accepts "
            r"\['kind', 'hidden', 'out', 'activate_last'\]",
        ),
        (
            {"factory": "a.b:c", "hiden": 1},
            {},
            r"unknown keys \['hiden'\]; a 'factory' model accepts \['kind', 'factory', 'kwargs'\]",
        ),
        ({"kind": "cnn"}, {}, "model.s.kind is 'cnn'; choose one of"),
        ({}, {}, "model.s.kind is None"),
        ({"kind": "mlp", "out": 2}, {}, "needs hidden = "),
        ({"kind": "mlp", "hidden": [4]}, {}, "needs out = "),
        (
            {"kind": "mlp", "hidden": [4], "out": 2},
            {"out_dim": 1},
            "model.s.out is 2 but the stage must output 1",
        ),
        (
            {"kind": "mlp", "hidden": [4], "out": 2, "activate_last": "yes"},
            {},
            "activate_last must be true or false",
        ),
        (
            {"kind": "mlp", "hidden": [0], "out": 2},
            {},
            r"\[model.s\]: hidden\[0\] must be a positive int",
        ),
        ({"kind": "embedding", "hidden": [4], "out": 2}, {}, "vocab is missing"),
        (
            {"kind": "embedding", "hidden": [4], "out": 2, "vocab": [3, 3]},
            {"vocab": [3, 4]},
            "the data's categorical columns have vocabularies",
        ),
        (
            {"kind": "embedding", "hidden": [4], "out": 2, "vocab": [3, 3, 3, 3]},
            {},
            "features have only 3 columns",
        ),
        (
            {"kind": "embedding", "hidden": [4], "out": 2, "vocab": [3]},
            {"in_dims": [2, 2]},
            "reads one input",
        ),
        (
            {"factory": "tests.models_fixture:functions_bottom", "kwargs": {"in_dim": 4, "out": 2}},
            {},
            r"inputs of widths \[4\], but the stage's inputs have widths \[3\]",
        ),
        (
            {"factory": "tests.models_fixture:functions_bottom", "kwargs": {"in_dim": 3, "out": 2}},
            {"out_dim": 1},
            "built a model with 2 outputs, but the stage must output 1",
        ),
        (
            {"factory": "tests.models_fixture:functions_bottom", "kwargs": 3},
            {},
            "kwargs must be a table",
        ),
    ],
)
def test_toml_refusals_name_the_key(table, kwargs, match):
    kwargs = {"in_dims": [3], **kwargs}
    with pytest.raises(ConfigError, match=match):
        model_from_toml(table, where="model.s", **kwargs)
