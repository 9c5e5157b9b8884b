"""Federated simulation of many virtual clients in one process (`simulate`), their training
optionally as Ray tasks (`on_ray`, imported on use: it needs the ``ray`` extra); see
docs/federated.md, "Simulation"."""

from .run import ClientPool, SimServer, VirtualClient, per_round_fraction, simulate
from .sources import ClientSource, FilePerClient, TablePartition

__all__ = [
    "ClientPool",
    "ClientSource",
    "FilePerClient",
    "SimServer",
    "TablePartition",
    "VirtualClient",
    "per_round_fraction",
    "simulate",
]
