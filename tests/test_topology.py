import pytest
from hypothesis import given

from tandem.engine.topology import (
    FEATURES,
    Stage,
    Topology,
    leader_follower,
    star,
    two_party,
    u_shape,
)
from tandem.errors import TopologyError
from tests.split_helpers import topologies


def test_builtin_topologies_have_expected_edges():
    assert [(e.src, e.dst) for e in two_party().edges()] == [("bottom", "top")]
    assert [(e.src, e.dst) for e in leader_follower().edges()] == [("bottom_follower", "top")]
    assert [(e.src_party, e.dst_party) for e in u_shape().edges()] == [("A", "B"), ("B", "A")]
    for k in (1, 2, 8):
        topo = star(k)
        assert len(topo.edges()) == k and topo.label_owner == "leader"
        assert len(topo.parties) == k + 1


@pytest.mark.parametrize(
    "stages, message",
    [
        (
            (Stage("a", "A", ("b",)), Stage("b", "B", ("a",)), Stage("l", "B", ("a",), loss=True)),
            "cycle",
        ),
        ((Stage("a", "", (FEATURES,)), Stage("l", "B", ("a",), loss=True)), "no owner"),
        ((Stage("a", "A", ("nope",)), Stage("l", "B", ("a",), loss=True)), "'nope'"),
        ((Stage("a", "A", (FEATURES,)), Stage("l", "B", ("a",))), "exactly one loss stage"),
        (
            (
                Stage("a", "A", (FEATURES,)),
                Stage("l", "B", ("a",), loss=True),
                Stage("m", "B", ("a",), loss=True),
            ),
            "exactly one loss stage",
        ),
        (
            (
                Stage("a", "A", (FEATURES,)),
                Stage("x", "A", (FEATURES,)),
                Stage("l", "B", ("a",), loss=True),
            ),
            "feeds nothing",
        ),
        ((Stage("a", "A", (FEATURES,)), Stage("a", "B", ("a",), loss=True)), "used twice"),
        ((), "no stages"),
    ],
)
def test_bad_topologies_are_rejected_with_a_message_naming_the_problem(stages, message):
    with pytest.raises(TopologyError, match=message):
        Topology(stages)


def test_star_rejects_bad_k():
    with pytest.raises(TopologyError, match="1 <= k"):
        star(0)


@given(topologies())
def test_topology_round_trips_through_json_dict(topo):
    again = Topology.from_dict(topo.to_dict())
    assert again == topo
    assert set(again.topological_order()) == set(topo.stages)
