"""`tandem.parties.split.admission`: what a party's admission refuses, field by field, and what
it takes (the frames its plan expects, in order)."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.engine.kernels import mlp_stage
from tandem.engine.topology import leader_follower
from tandem.errors import AdmissionError
from tandem.parties.split import SplitConfig, SplitParty
from tandem.parties.split.admission import negotiation_streams, spec_streams
from tandem.transports.base import Frame
from tandem.transports.memory import MemoryNetwork

ACT, GRAD = "act/bottom_follower->top", "grad/bottom_follower->top"


@pytest.fixture(scope="module")
def parties():
    topo = leader_follower()
    models = {
        "bottom_leader": mlp_stage([4], [], 3),
        "bottom_follower": mlp_stage([5], [], 3),
        "top": mlp_stage([3, 3], [4], 1, activate_last=False),
    }
    net = MemoryNetwork()
    cfg = SplitConfig(batch_size=16, groups=2, chunks=2, seed=0)
    data = {"train": np.zeros((40, 5), np.float32)}
    leader = SplitParty(
        "leader",
        topo,
        models,
        net.endpoint("leader"),
        datasets={"train": np.zeros((40, 4), np.float32)},
        labels={"train": np.zeros(40, np.float32)},
        config=cfg,
    )
    follower = SplitParty(
        "follower", topo, models, net.endpoint("follower"), datasets=data, config=cfg
    )
    return leader, follower


def refused(check, frame: Frame) -> str:
    with pytest.raises(AdmissionError) as info:
        check(frame)
    return info.value.field


def msg(channel, b, m, rows, width=3, dtype=np.float32, n=1):
    return Frame(
        sender="x",
        channel=channel,
        meta={"b": b, "m": m},
        arrays=tuple(np.zeros((rows, width), dtype) for _ in range(n)),
    )


def test_messages_are_checked_against_the_announced_batch(parties):
    leader, _ = parties
    adm = leader.admission
    adm.batches.clear()
    adm.admitted.clear()
    adm.announce(0, 16, 2, 2, "train")  # 2 groups of 8 rows, 2 messages each: 4 rows apiece
    assert refused(adm, msg(ACT, 7, 0, 4)) == "b"  # not a batch it runs
    assert refused(adm, msg(ACT, True, 0, 4)) == "b"
    assert refused(adm, msg(ACT, 0, 1, 4)) == "m"  # message 0 comes first
    assert refused(adm, msg(ACT, 0, 0, 1)) == "rows"  # one row instead of the group's four
    assert refused(adm, msg(ACT, 0, 0, 4, width=5)) == "shape"
    assert refused(adm, msg(ACT, 0, 0, 4, dtype=np.float64)) == "shape"
    assert refused(adm, msg(ACT, 0, 0, 4, n=2)) == "arrays"
    for m in range(4):  # the plan's messages, in order, are taken
        adm(msg(ACT, 0, m, 4))
    assert refused(adm, msg(ACT, 0, 4, 4)) == "m"  # all four arrived
    adm.announce(1, 16, 2, 2, "eval")
    assert refused(adm, msg(GRAD, 1, 0, 4)) == "b"  # an eval batch sends no gradient back


def test_a_followers_batch_commands_are_checked(parties):
    _, follower = parties
    adm = follower.admission
    adm.batches.clear()
    adm.admitted.clear()
    idx = np.arange(16, dtype=np.int64)

    def cmd(**over):
        meta = {"cmd": "batch", "b": 0, "n": 2, "c": 2, "mode": "train", "data": "train"}
        meta.update(over)
        arrays = over.pop("arrays", (idx,))
        return Frame(sender="leader", channel="ctl", meta=meta, arrays=arrays)

    assert refused(adm, cmd(cmd="explode")) == "cmd"
    assert refused(adm, cmd(b=3)) == "b"  # the next batch is 0
    assert refused(adm, cmd(n=17)) == "n"
    assert refused(adm, cmd(c=3)) == "c"  # chunks=2 fits 8-row groups: c must be 2
    assert refused(adm, cmd(mode="predict")) == "mode"
    assert refused(adm, cmd(data="test")) == "data"
    bad_rows = Frame(
        sender="leader", channel="ctl", meta=cmd().meta, arrays=(np.arange(30, 46, dtype=np.int64),)
    )
    assert refused(adm, bad_rows) == "idx"  # rows past the dataset's 40
    adm(Frame(sender="leader", channel="ctl", meta={"cmd": "stop"}))
    adm(cmd())  # batch 0 is announced
    assert refused(adm, cmd()) == "b"  # batch 0 again: the next is 1
    for m in range(4):
        adm(msg(GRAD, 0, m, 4))
    assert refused(adm, msg(GRAD, 0, 0, 4)) == "m"


def test_stream_admission_before_and_after_negotiation():
    before = negotiation_streams("follower", "leader", ["leader", "follower"])
    before("leader", "ctl")
    with pytest.raises(AdmissionError, match="not part of the negotiated task") as info:
        before("leader", ACT)
    assert info.value.field == "channel"
    with pytest.raises(AdmissionError) as info:
        before("mallory", "ctl")
    assert info.value.field == "sender"

    class Spec:
        edges = [
            {
                "src": "bottom_follower",
                "dst": "top",
                "src_party": "follower",
                "dst_party": "leader",
            },
            {"src": "bottom_leader", "dst": "top", "src_party": "leader", "dst_party": "leader"},
        ]

    lead = spec_streams(Spec, "leader", "leader")  # type: ignore[arg-type]
    lead("follower", ACT)
    lead("follower", "ctl")
    with pytest.raises(AdmissionError) as info:
        lead("follower", GRAD)  # the leader sends gradients, it does not receive them
    assert info.value.field == "channel"
    fol = spec_streams(Spec, "follower", "leader")  # type: ignore[arg-type]
    fol("leader", GRAD)
    with pytest.raises(AdmissionError) as info:
        fol("mallory", GRAD)
    assert info.value.field == "sender"
