"""Loopback ports for the tests: `tandem.transports.ports`, which the benchmarks that start
servers in other processes use too (its docstring says how ports are chosen)."""

from tandem.transports.ports import LOWEST, PortPool, _ephemeral_start, free_port, free_ports

__all__ = ["LOWEST", "PortPool", "_ephemeral_start", "free_port", "free_ports"]
