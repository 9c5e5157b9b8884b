"""Downlink deltas rebuild the server's model bit for bit for any participation history."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from tandem.errors import ConfigError
from tandem.parties.fl.downlink import ClientModel, DownlinkPlanner, index_dtype
from tandem.parties.fl.protocol import DownlinkError

D = 24
CLIENTS = 3

step = st.tuples(
    st.one_of(st.none(), st.lists(st.integers(0, D - 1), min_size=1, max_size=4, unique=True)),
    st.lists(st.booleans(), min_size=CLIENTS, max_size=CLIENTS),  # who takes part
    st.lists(st.booleans(), min_size=CLIENTS, max_size=CLIENTS),  # whose reply is accepted
    st.integers(0, 2**31),
)


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, np.float32).tobytes()


@settings(max_examples=examples(120), deadline=None, derandomize=True)
@given(
    mode=st.sampled_from(["full", "initial", "version", "anchor"]),
    log_size=st.integers(1, 4),
    anchor_every=st.integers(1, 4),
    history=st.lists(step, max_size=14),
)
def test_clients_rebuild_server_model_exactly(mode, log_size, anchor_every, history):
    init = np.random.default_rng(0).normal(size=D).astype(np.float32)
    model = init.copy()
    planner = DownlinkPlanner(D, mode, log_size=log_size, anchor_every=anchor_every)
    clients = [ClientModel(init) for _ in range(CLIENTS)]
    known = [0] * CLIENTS
    for changed, present, accepted, seed in history:
        if planner.anchor_due():
            planner.set_anchor()
            for c in range(CLIENTS):  # the broadcast reaches the present clients only
                if present[c]:
                    clients[c].apply({"kind": "full", "version": planner.version}, (model,))
                    known[c] = planner.version
        for c in range(CLIENTS):
            if not present[c]:
                continue
            meta, arrays = planner.plan(model, known[c])
            got = clients[c].apply(meta, arrays)
            assert _bits(got) == _bits(model)
            if accepted[c]:
                known[c] = clients[c].version
        vals = np.random.default_rng(seed).normal(size=D).astype(np.float32)
        model = model.copy()
        if changed is None:
            model += vals
        else:
            model[changed] += vals[: len(changed)]
        planner.record(None if changed is None else np.asarray(changed))


def test_sparse_deltas_are_smaller_than_the_model_and_far_behind_gets_full():
    d = 1000
    model = np.zeros(d, np.float32)
    planner = DownlinkPlanner(d, "version", log_size=2)
    for v in range(3):
        model[[v, v + 10]] += 1.0
        planner.record(np.array([v, v + 10]))
    meta, (idx, vals) = planner.plan(model, 2)
    assert meta == {"kind": "delta", "version": 3, "base": 2}
    assert idx.dtype == np.uint16 and list(idx) == [2, 12]
    assert planner.plan(model, 1)[0]["kind"] == "delta"  # log still covers 2..3
    assert planner.plan(model, 0)[0]["kind"] == "full"  # evicted from the log
    assert index_dtype(70_000) == np.uint32


def test_client_refuses_delta_from_the_future_and_keeps_state():
    c = ClientModel(np.zeros(4, np.float32))
    with pytest.raises(DownlinkError, match="must send the full model"):
        c.apply(
            {"kind": "delta", "version": 5, "base": 3},
            (np.array([1], np.uint16), np.array([1.0], np.float32)),
        )
    assert c.version == 0 and not c.model.any()
    with pytest.raises(DownlinkError, match="unknown model message kind"):
        c.apply({"kind": "weird", "version": 1}, ())
    with pytest.raises(ConfigError, match="downlink mode"):
        DownlinkPlanner(4, "sometimes")


def test_client_holds_models_without_copying_and_never_writes_them():
    initial = np.arange(4, dtype=np.float32)
    initial.flags.writeable = False  # as a trainer's init_vec
    c = ClientModel(initial)
    assert np.shares_memory(c.model, initial)  # a read-only model is held as it is
    mine = np.zeros(4, np.float32)
    assert not np.shares_memory(ClientModel(mine).model, mine)  # a writable one is copied
    received = np.full(4, 2.0, np.float32)  # a received frame's array, the client's own
    assert c.apply({"kind": "full", "version": 1}, (received,)) is c.model
    assert np.shares_memory(c.model, received) and not c.model.flags.writeable
    held = c.model
    c.apply({"kind": "delta", "version": 2, "base": 1}, (np.array([3], np.uint16), np.ones(1)))
    assert c.model.tolist() == [2, 2, 2, 1] and held.tolist() == [2, 2, 2, 2]
    assert initial.tolist() == [0, 1, 2, 3] and not c.model.flags.writeable


async def test_client_skips_a_message_it_cannot_apply_and_keeps_serving():
    from fl_helpers import small_setup
    from tandem.parties.fl import protocol as P
    from tandem.parties.fl.client import FLClient
    from tandem.transports.base import Frame
    from tandem.transports.memory import MemoryNetwork

    data, trainer = small_setup()
    net = MemoryNetwork()
    server, ct = net.endpoint("server"), net.endpoint("c0")
    client = FLClient(ct, "server", *data.clients[0], trainer)
    bad = Frame(
        meta={"kind": "delta", "version": 9, "base": 5, "train": True},
        arrays=(np.array([1], np.uint16), np.array([1.0], np.float32)),
    )
    await server.send("c0", P.MODEL, bad)
    await server.send("c0", P.MODEL, Frame(meta={"kind": "stop"}))
    await client.run()
    assert len(client.errors) == 1 and "must send the full model" in client.errors[0]
