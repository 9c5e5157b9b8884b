"""What each elastic role builds from its checked file: its transport and the coordinator's
settings. Shared by the role commands (`cli`) and the Ray actors (`ray.roles`)."""

from __future__ import annotations

import asyncio
from typing import Any

from .config import CoordinatorFile, DataServerFile, RoleFile


def role_transport(cfg: RoleFile, peers: dict[str, str], *, admit_unknown: bool = False):
    """``async with`` this role's started transport, built by `make_transport` for its peers'
    URL scheme with the file's security settings. Elastic roles tell each other where they
    live: it must have addresses."""
    from tandem.transports.factory import addressing, common_scheme, make_transport, started

    transport = make_transport(
        common_scheme(peers.values()),
        name=cfg.name,
        host=cfg.host,
        port=cfg.port,
        peers=peers,
        advertise_url=cfg.advertise_url,
        admit_unknown=admit_unknown,
        **cfg.transport_settings(),
    )
    addressing(transport, "an elastic role")
    return started(transport)


def coordinator_config(cfg: CoordinatorFile):
    """The `CoordinatorConfig` of a checked coordinator file."""
    from .coordinator import CoordinatorConfig

    return CoordinatorConfig(
        data_servers=tuple(cfg.data_servers),
        data_server_urls=tuple(cfg.data_servers.items()),
        interval=cfg.interval,
        timeout=cfg.timeout,
        drain=cfg.drain,
        epochs=cfg.epochs,
        min_workers=cfg.min_workers,
        on_change=cfg.on_change,
        call_timeout=cfg.call_timeout,
        recover_timeout=cfg.recover_timeout,
        journal=cfg.journal,
    )


async def load_data_server(cfg: DataServerFile, path: str) -> tuple[Any, Any, Any, Any]:
    """``(spec, shard, store, party)`` of a checked data-server file read from ``path``: the
    shard from its ``[data]`` table (``party`` the loaded `PartyShard`), or from its model
    spec and shard files (``party`` None); ``store`` its `CheckpointStore` or None. Files are
    read in a thread, off the loop."""
    from .party_data import load_party_shard
    from .spec import load_shard, load_spec
    from .store import CheckpointStore

    party = None
    if cfg.data is not None:
        party = await asyncio.to_thread(load_party_shard, cfg.contract(), path=path)
        spec, shard = party.spec, party.train
    else:
        assert isinstance(cfg.model, str) and cfg.shard is not None  # DataServerFile._shard
        spec = load_spec(cfg.model)
        shard = await asyncio.to_thread(load_shard, cfg.shard, spec)
    store = CheckpointStore(cfg.checkpoints) if cfg.checkpoints is not None else None
    return spec, shard, store, party


def data_server(t, cfg, spec, shard, store, party):
    """The `DataServer` of a data server's file ``cfg`` on transport ``t`` (started), serving
    ``shard`` of ``spec``; ``party`` is its loaded table (None for a pre-built shard), which
    brings the test rows, the preprocessing and the data's fingerprint."""
    from .data_server import DataServer

    return DataServer(
        t,
        coordinator=cfg.coordinator_name,
        spec=spec,
        shard=shard,
        url=cfg.advertise_url or t.url,
        store=store,
        coordinator_wait=cfg.coordinator_wait,
        test=party.test if party else None,
        export=cfg.export,
        preprocessing=party.preprocessing if party else None,
        fingerprint=party.fingerprint if party else None,
    )
