"""Loopback ports for the tests: `bench.ports`, which the benchmarks that start servers in
other processes use too (its docstring says how ports are chosen)."""

from bench.ports import LOWEST, PortPool, _ephemeral_start, free_port, free_ports

__all__ = ["LOWEST", "PortPool", "_ephemeral_start", "free_port", "free_ports"]
