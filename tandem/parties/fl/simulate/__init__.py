"""Federated simulation of many virtual clients in one process (`simulate`), their training
optionally as Ray tasks (`on_ray`, imported on use: it needs the ``ray`` extra); see
docs/federated.md, "Simulation".

The names below are imported on first use: ``tandem fl`` registers the ``simulate`` command
from `tandem.parties.fl.simulate.cli`, and a federated client or server started by that
command line need not load the simulator (and with it JAX) to do so."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .run import ClientPool, SimServer, VirtualClient, per_round_fraction, simulate
    from .sources import ClientSource, FilePerClient, TablePartition

_HOME = {
    "ClientPool": ".run",
    "ClientSource": ".sources",
    "FilePerClient": ".sources",
    "SimServer": ".run",
    "TablePartition": ".sources",
    "VirtualClient": ".run",
    "per_round_fraction": ".run",
    "simulate": ".run",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name], __name__), name)


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
