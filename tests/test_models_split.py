"""Split learning with every kind of model, end to end: a leader with an embedding bottom and
the top, and three followers with a Flax linen, a Flax nnx and an Equinox bottom, train over
the memory transport; each party's export then rebuilds its stages (`inference.load_model`)
and cross-party prediction equals the trained in-process model's."""

from __future__ import annotations

import asyncio
import os

import jax
import numpy as np
import pytest

from tandem.engine.topology import star, two_party
from tandem.errors import ConfigError
from tandem.parties.export import save_stages
from tandem.parties.models import embedding_mlp, load_factory, mlp
from tandem.parties.split import SplitConfig, SplitParty, inference
from tandem.parties.split.inference import InferenceError
from tandem.transports.memory import MemoryNetwork

CUT, DENSE, VOCAB, FEAT, ROWS, NEW, BATCH = 4, 2, 5, 3, 96, 23, 16
FOLLOWER_MODELS = ("linen_bottom", "nnx_bottom", "equinox_bottom")


def models():
    bottoms = {
        f"bottom_{i}": load_factory(
            f"tests.models_fixture:{name}", {"in_dim": FEAT, "hidden": 8, "out": CUT}
        )
        for i, name in enumerate(FOLLOWER_MODELS)
    }
    return {
        **bottoms,
        "bottom_leader": embedding_mlp(DENSE, [VOCAB], dim=3, hidden=[8], out_dim=CUT),
        "top": mlp([CUT] * 4, [8], 1, activate_last=False),
    }


def data(rng, rows):
    codes = rng.integers(1, VOCAB, size=(rows, 1)).astype(np.float32)
    leader = np.concatenate([rng.normal(size=(rows, DENSE)), codes], axis=1)
    followers = [rng.normal(size=(rows, FEAT)) for _ in FOLLOWER_MODELS]
    score = followers[0][:, 0] + followers[2][:, 1] + (2.0 * (codes[:, 0] % 2) - 1.0)
    return leader.astype(np.float32), [f.astype(np.float32) for f in followers], score > 0


async def train_and_export(root: str):
    rng = np.random.default_rng(0)
    xl, xfs, y = data(rng, ROWS)
    new_l, new_fs, _ = data(rng, NEW)
    topo, net = star(len(FOLLOWER_MODELS), leader_bottom=True), MemoryNetwork()
    cfg = SplitConfig(batch_size=BATCH, groups=2, learning_rate=0.05, seed=0)
    leader = SplitParty(
        "leader",
        topo,
        models(),
        net.endpoint("leader"),
        datasets={"train": xl, "new": new_l},
        labels={"train": y.astype(np.float32)},
        config=cfg,
    )
    followers = [
        SplitParty(
            f"follower{i}",
            topo,
            models(),
            net.endpoint(f"follower{i}"),
            datasets={"train": x, "new": x_new},
            config=cfg,
        )
        for i, (x, x_new) in enumerate(zip(xfs, new_fs, strict=True))
    ]
    async with asyncio.TaskGroup() as tg:
        for f in followers:
            tg.create_task(f.serve())
        history = await leader.fit(6)
        reference = await leader.predict("new", NEW, batch_size=BATCH)
        await leader.stop()
    paths = {}
    for party in (leader, *followers):
        paths[party.name] = os.path.join(root, f"{party.name}.safetensors")
        await inference.export_party(party, paths[party.name])
    return history, reference, paths, new_l, new_fs


async def test_every_model_kind_trains_exports_and_predicts(tmp_path):
    history, reference, paths, new_l, new_fs = await train_and_export(str(tmp_path))
    assert history[-1].loss < 0.8 * history[0].loss
    loaded = {p: await inference.load_model(path, p) for p, path in paths.items()}
    specs = {name: m.spec for lm in loaded.values() for name, m in lm.models.items() if m.spec}
    assert specs["bottom_leader"]["kind"] == "embedding"
    assert [specs[f"bottom_{i}"]["factory"] for i in range(3)] == [
        f"tests.models_fixture:{n}" for n in FOLLOWER_MODELS
    ]
    net = MemoryNetwork()
    async with asyncio.TaskGroup() as tg:
        served = [
            tg.create_task(inference.serve(net.endpoint(f"follower{i}"), loaded[f"follower{i}"], x))
            for i, x in enumerate(new_fs)
        ]
        result = await inference.predict(
            net.endpoint("leader"), loaded["leader"], new_l, batch_size=BATCH, groups=2
        )
    assert [t.result() for t in served] == [-(-NEW // BATCH)] * 3
    assert result.outputs.shape == (NEW, 1)
    np.testing.assert_allclose(result.outputs, reference, rtol=1e-5, atol=1e-6)


def _export_one(path, model, spec, params=None):
    """A single-party export of ``model``'s params under the recorded ``spec``."""
    params = model.init(jax.random.PRNGKey(0)) if params is None else params
    host = jax.tree_util.tree_map(np.asarray, params)
    save_stages(
        path,
        {"bottom": host},
        topology=two_party().to_dict(),
        party="A",
        models={"bottom": spec},
        widths={"bottom": model.out_dim, "top": 1},
        training="t0",
    )


def test_load_refuses_an_export_whose_reference_cannot_be_imported(tmp_path):
    model = load_factory("tests.models_fixture:functions_bottom", {"in_dim": 3, "out": 2})
    spec = {**model.spec, "factory": "gone_pkg_xyz.models:functions_bottom"}
    _export_one(tmp_path / "A.safetensors", model, spec)
    with pytest.raises(ConfigError, match="cannot import 'gone_pkg_xyz.models'"):
        inference.load_model_sync(tmp_path / "A.safetensors", "A")


@pytest.mark.parametrize(
    "spec",
    [
        {
            "kind": "factory",
            "factory": "tests.models_fixture:functions_bottom",
            "kwargs": {"in_dim": 3, "out": 3},
        },
        {
            "kind": "embedding",
            "n_dense": 2,
            "vocab": [4],
            "dim": 3,
            "hidden": [],
            "out_dim": 2,
            "activate_last": True,
        },
    ],
    ids=["other-kwargs", "other-kind"],
)
def test_load_refuses_params_that_do_not_fit_the_recorded_model(tmp_path, spec):
    model = load_factory("tests.models_fixture:functions_bottom", {"in_dim": 3, "out": 2})
    _export_one(tmp_path / "A.safetensors", model, spec)
    with pytest.raises(InferenceError, match="do not fit its recorded model spec"):
        inference.load_model_sync(tmp_path / "A.safetensors", "A")


def test_export_refuses_a_model_without_a_reference(tmp_path):
    from tandem.parties.models import from_functions

    plain = from_functions(
        lambda k: {"w": jax.random.normal(k, (3, 2))}, lambda p, x: x @ p["w"], [3]
    )
    topo, net = two_party(), MemoryNetwork()
    stages = {"bottom": plain, "top": mlp([2], [], 1, activate_last=False)}
    a = SplitParty("A", topo, stages, net.endpoint("A"), datasets={"train": np.ones((4, 3))})
    a.run_id = "t0"
    with pytest.raises(InferenceError, match="reference='package.module:function'"):
        asyncio.run(inference.export_party(a, tmp_path / "A.safetensors"))
