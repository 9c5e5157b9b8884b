"""`ports.PortPool`: below the kernel's ephemeral range, one slice per xdist worker, never a
port twice, never a port something listens on."""

import socket

import pytest

from ports import LOWEST, PortPool, _ephemeral_start


def test_workers_draw_from_disjoint_slices_below_the_ephemeral_range():
    third = (_ephemeral_start() - LOWEST) // 3
    pools = [PortPool(i, 3, pid=1234) for i in range(3)]
    drawn = [[pool.take() for _ in range(50)] for pool in pools]
    for i, ports in enumerate(drawn):
        assert len(set(ports)) == 50
        assert all(LOWEST + i * third <= p < LOWEST + (i + 1) * third for p in ports), i
    assert PortPool(0, 3, pid=1234).take() == drawn[0][0]  # the pid fixes the start


def test_a_port_in_use_or_given_is_skipped():
    pool = PortPool(0, 1, pid=0)
    given = pool.take()
    pool._cursor -= 1  # back to the port just given
    with socket.create_server(("127.0.0.1", given + 1)):  # and the next one listens
        assert pool.take() == given + 2


def test_a_worker_outside_the_count_is_refused():
    with pytest.raises(ValueError, match="outside 0..1"):
        PortPool(2, 2, pid=0)
