"""Tandem: train one model across parties that do not share their data.

The public surface, each name re-exported from the module that defines it:

* split learning: `SplitParty`, `SplitConfig`, `EpochResult`, `run_party` (one party of a TOML
  configuration, as ``tandem party`` runs it);
* topologies: `Topology`, `two_party`, `leader_follower`, `u_shape`, `star`;
* the stage model contract: `StageModel` (an ``(init, apply)`` pair) and `mlp_stage`;
* transports: `Transport`, `Frame`, `MemoryNetwork`, `HttpTransport`, `HttpConfig`;
* horizontal FL: `FLServer`, `FLClient`, `FLConfig`;
* elastic training: `Coordinator`, `DataServer`, `Worker`, `LocalCluster`;
* errors: `TandemError` (the root of every error Tandem raises on purpose) and `ConfigError`.

Names are imported on first use, so ``import tandem.engine.plan`` (pure planning code) does not
pull in JAX or asyncio. Everything else lives in `tandem.engine`, `tandem.transports` and
`tandem.parties` and may change between minor versions.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

_EXPORTS = {
    "SplitParty": "tandem.parties.split.party",
    "SplitConfig": "tandem.parties.split.party",
    "EpochResult": "tandem.parties.split.party",
    "run_party": "tandem.parties.split.process.standalone",
    "Topology": "tandem.engine.topology",
    "two_party": "tandem.engine.topology",
    "leader_follower": "tandem.engine.topology",
    "u_shape": "tandem.engine.topology",
    "star": "tandem.engine.topology",
    "StageModel": "tandem.engine.kernels",
    "mlp_stage": "tandem.engine.kernels",
    "Transport": "tandem.transports.base",
    "Frame": "tandem.transports.base",
    "MemoryNetwork": "tandem.transports.memory",
    "HttpTransport": "tandem.transports.http",
    "HttpConfig": "tandem.transports.http",
    "FLServer": "tandem.parties.fl.server",
    "FLClient": "tandem.parties.fl.client",
    "FLConfig": "tandem.parties.fl.server",
    "Coordinator": "tandem.parties.elastic.coordinator",
    "DataServer": "tandem.parties.elastic.data_server",
    "Worker": "tandem.parties.elastic.worker",
    "LocalCluster": "tandem.parties.elastic.local",
    "TandemError": "tandem.errors",
    "ConfigError": "tandem.errors",
}

__all__ = [
    "__version__",
    "SplitParty",
    "SplitConfig",
    "EpochResult",
    "run_party",
    "Topology",
    "two_party",
    "leader_follower",
    "u_shape",
    "star",
    "StageModel",
    "mlp_stage",
    "Transport",
    "Frame",
    "MemoryNetwork",
    "HttpTransport",
    "HttpConfig",
    "FLServer",
    "FLClient",
    "FLConfig",
    "Coordinator",
    "DataServer",
    "Worker",
    "LocalCluster",
    "TandemError",
    "ConfigError",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from tandem.engine.kernels import StageModel, mlp_stage
    from tandem.engine.topology import Topology, leader_follower, star, two_party, u_shape
    from tandem.errors import ConfigError, TandemError
    from tandem.parties.elastic.coordinator import Coordinator
    from tandem.parties.elastic.data_server import DataServer
    from tandem.parties.elastic.local import LocalCluster
    from tandem.parties.elastic.worker import Worker
    from tandem.parties.fl.client import FLClient
    from tandem.parties.fl.server import FLConfig, FLServer
    from tandem.parties.split.party import EpochResult, SplitConfig, SplitParty
    from tandem.parties.split.process.standalone import run_party
    from tandem.transports.base import Frame, Transport
    from tandem.transports.http import HttpConfig, HttpTransport
    from tandem.transports.memory import MemoryNetwork
