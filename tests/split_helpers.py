"""Shared builders for split-learning tests: generated topologies and small jobs."""

from __future__ import annotations

import asyncio

import numpy as np
from hypothesis import strategies as st

from tandem.engine.kernels import mlp_stage
from tandem.engine.topology import FEATURES, Stage, Topology
from tandem.parties.split import SplitConfig, SplitParty
from tandem.transports.memory import MemoryNetwork


@st.composite
def topologies(draw, max_parties: int = 4, max_stages: int = 6) -> Topology:
    """Random valid topologies: bottoms on random parties, inner stages over earlier stages,
    and a loss stage consuming every stage nobody else consumes."""
    n_parties = draw(st.integers(2, max_parties))
    parties = [f"p{i}" for i in range(n_parties)]
    n_inner = draw(st.integers(1, max_stages - 1))
    stages: list[Stage] = []
    for i in range(n_inner):
        owner = draw(st.sampled_from(parties))
        earlier = [s.name for s in stages]
        if earlier and draw(st.booleans()):
            k = draw(st.integers(1, min(2, len(earlier))))
            inputs = tuple(draw(st.permutations(earlier))[:k])
        else:
            inputs = (FEATURES,)
        stages.append(Stage(f"s{i}", owner, inputs))
    consumed = {i for s in stages for i in s.inputs}
    last = tuple(s.name for s in stages if s.name not in consumed)
    stages.append(Stage("loss", draw(st.sampled_from(parties)), last, loss=True))
    return Topology(tuple(stages))


def models_for(topo: Topology, width: int = 3, feat: int = 4, out: int = 1):
    models = {}
    for s in topo.stages:
        dims = [feat if i == FEATURES else width for i in s.inputs]
        if s.loss:
            models[s.name] = mlp_stage(dims, [5], out, activate_last=False)
        else:
            models[s.name] = mlp_stage(dims, [5], width)
    return models


def make_job(
    topo: Topology,
    *,
    rows: int = 24,
    seed: int = 0,
    feat: int = 4,
    config: SplitConfig | None = None,
    network: MemoryNetwork | None = None,
    trace=None,
):
    rng = np.random.default_rng(seed)
    net = network or MemoryNetwork()
    models = models_for(topo, feat=feat)
    cfg = config or SplitConfig(
        batch_size=rows,
        groups=1,
        optimizer="sgd",
        learning_rate=0.1,
        seed=seed,
        threshold=2,
        capacity=16,
    )
    data = {p: rng.normal(size=(rows, feat)).astype(np.float32) for p in topo.parties}
    labels = (rng.random(rows) > 0.5).astype(np.float32)
    parties = {}
    for p in topo.parties:
        parties[p] = SplitParty(
            p,
            topo,
            models,
            net.endpoint(p),
            datasets={"train": data[p]},
            labels={"train": labels} if p == topo.label_owner else None,
            config=cfg,
            trace=trace,
        )
    return parties, data, labels, models


async def train_steps(parties, topo: Topology, batches, n_of):
    """Run ``batches`` (row index arrays) with n = n_of(i) on every party; returns the leader."""
    leader = parties[topo.label_owner]

    async def drive():
        for i, idx in enumerate(batches):
            await leader.run_batch(idx, n=n_of(i))
        await leader.stop()

    async with asyncio.TaskGroup() as tg:
        for p, party in parties.items():
            if p != topo.label_owner:
                tg.create_task(party.serve())
        tg.create_task(drive())
    return leader
