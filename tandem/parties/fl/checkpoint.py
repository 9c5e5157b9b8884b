"""The federated server's checkpoint: one safetensors file, written atomically, never pickled.

Contents (format ``"tandem-fl-server"``, version 1):

* tensors: ``model`` (the flat global model), ``momentum`` and ``residual`` (`ServerState`),
  ``opt/<i>`` (the leaves of the server optimizer's state, in ``jax.tree_util`` order),
  ``agg/<i>`` (the leaves of the aggregator's state, `FLConfig.aggregator`, likewise),
  ``planner/...`` (`DownlinkPlanner.state`: changed-coordinate masks and the version log);
* header metadata ``"tandem"``: JSON ``{"format", "version", "identity", "next_round",
  "known", "participation", "resyncs", "reports", "planner", "opt_structure", "agg_structure",
  "lineage"}``: the configuration it was written with (`ServerConfig.identity`), the first round
  not yet done, each client's confirmed version, each client's count of rounds its payload went
  into (`FLServer.participation`, for the epsilon against the server; a checkpoint without it
  has it counted from its reports' ``accepted``), the round reports so far, the planner's
  scalars and the treedef texts of the optimizer's and the aggregator's states (a checkpoint
  without ``agg_structure`` holds an aggregator without state, as the default weighted mean),
  and the server's lineage (`FLServer.lineage`: a resumed server keeps it, so the versions its
  clients hold stay valid; a checkpoint without one gives the server a new lineage, and its
  clients then start again from the initial model).

`save` writes the bytes to a temporary name beside ``location`` and renames it over
``location`` (local files: ``os.replace`` after an fsync of the file, then an fsync of the
folder; other fsspec file systems: their ``mv``), so a reader, or a server restarted after
``kill -9`` at any moment, finds the previous checkpoint or the new one, never a mix. A
temporary file left by a killed writer (``.<name>.<random>.tmp``) is removed by the next save.
`load` returns None when there is no checkpoint; `restore` refills a freshly built server and
refuses a checkpoint written for another configuration, naming what differs and ``--fresh``.

``save``/``load`` do blocking I/O: call them off the event loop (``asyncio.to_thread``).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from tandem.errors import ConfigError
from tandem.parties.files import write_atomic

from .aggregate import ServerState
from .server import FLServer, RoundReport

FORMAT = "tandem-fl-server"
VERSION = 1
_META = "tandem"


class CheckpointError(ConfigError):
    """A server checkpoint cannot be read, or was written for another configuration."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A read checkpoint: its tensors and its metadata (see the module docstring)."""

    location: str
    tensors: dict[str, np.ndarray]
    meta: dict[str, Any]

    @property
    def next_round(self) -> int:
        return int(self.meta["next_round"])


def encode(server: FLServer, identity: Mapping[str, Any]) -> bytes:
    """The checkpoint of ``server`` as bytes (a safetensors file)."""
    tensors: dict[str, np.ndarray] = {
        "model": np.asarray(server.model, np.float32),
        "momentum": np.asarray(server.state.momentum, np.float32),
        "residual": np.asarray(server.state.residual, np.float32),
    }
    treedefs = {}
    for prefix, state in (("opt", server.opt_state), ("agg", server.agg_state)):
        leaves, treedefs[prefix] = jax.tree_util.tree_flatten(state)
        for i, leaf in enumerate(leaves):
            tensors[f"{prefix}/{i}"] = np.asarray(leaf)
    planner_arrays, planner_meta = server.planner.state()
    for name, arr in planner_arrays.items():
        tensors[f"planner/{name}"] = arr
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "identity": json.loads(json.dumps(identity)),
        "next_round": server.next_round,
        "known": dict(server.known),
        "participation": dict(server.participation),
        "resyncs": server.resyncs,
        "reports": [dataclasses.asdict(r) for r in server.reports],
        "planner": planner_meta,
        "opt_structure": str(treedefs["opt"]),
        "agg_structure": str(treedefs["agg"]),
        "lineage": server.lineage,
    }
    contiguous = {k: np.array(v, order="C") for k, v in tensors.items()}  # keeps 0-d arrays 0-d
    return safetensors.numpy.save(contiguous, metadata={_META: json.dumps(meta, sort_keys=True)})


def save(location: str, server: FLServer, identity: Mapping[str, Any]) -> None:
    """Write ``server``'s checkpoint to ``location`` atomically (see the module docstring)."""
    write_atomic(location, encode(server, identity))


def load(location: str) -> Checkpoint | None:
    """The checkpoint at ``location``, or None when there is none."""
    import fsspec

    try:
        with fsspec.open(location, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return None
    meta = _metadata(blob, location)
    try:
        tensors = safetensors.numpy.load(blob)
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise CheckpointError(f"checkpoint {location!r} is corrupt: {exc}") from None
    return Checkpoint(location, dict(tensors), meta)


def restore(server: FLServer, ckpt: Checkpoint, identity: Mapping[str, Any]) -> None:
    """Refill a freshly built ``server`` from ``ckpt``; raises `CheckpointError` when the
    checkpoint was written with another configuration or does not fit this model."""
    saved = ckpt.meta.get("identity")
    expected = json.loads(json.dumps(identity))
    if saved != expected:
        differ = sorted(
            k for k in set(expected) | set(saved or {}) if (saved or {}).get(k) != expected.get(k)
        )
        raise CheckpointError(
            f"checkpoint {ckpt.location!r} was written by a server configured differently "
            f"(differs in: {differ}); restore that configuration to resume, or start over "
            "with --fresh (the checkpoint is then overwritten)"
        )
    t = ckpt.tensors
    where = f"checkpoint {ckpt.location!r}"
    for name in ("model", "momentum", "residual"):
        if name not in t or t[name].shape != (server.d,) or t[name].dtype != np.float32:
            raise CheckpointError(
                f"{where}: tensor {name!r} is missing or not float32 ({server.d},); the file "
                "is damaged: start over with --fresh"
            )
    opt_state = _state(server.opt_state, ckpt, "opt", "the server optimizer")
    agg_state = _state(server.agg_state, ckpt, "agg", "the aggregator")
    planner = {k.removeprefix("planner/"): v for k, v in t.items() if k.startswith("planner/")}
    try:
        server.planner.restore(planner, ckpt.meta["planner"])
        known = {str(c): int(v) for c, v in ckpt.meta["known"].items()}
        reports = [RoundReport(**r) for r in ckpt.meta["reports"]]
        participation = _participation(ckpt.meta.get("participation"), reports)
        next_round, resyncs = int(ckpt.meta["next_round"]), int(ckpt.meta["resyncs"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{where}: metadata is malformed ({exc!r})") from None
    server.model = np.array(t["model"], np.float32, copy=True)
    server.state = ServerState(jnp.asarray(t["momentum"]), jnp.asarray(t["residual"]))
    server.opt_state, server.agg_state = opt_state, agg_state
    server.known.update({c: v for c, v in known.items() if c in server.known})
    server.reports = reports
    server.participation = participation
    server.next_round, server.resyncs = next_round, resyncs
    lineage = ckpt.meta.get("lineage")
    if isinstance(lineage, str):
        server.lineage = lineage


def _participation(saved: Any, reports: list[RoundReport]) -> dict[str, int]:
    """Each client's count of rounds taken part in: as saved, else (a checkpoint written
    before it was kept) counted from the reports' ``accepted``; `restore` turns a malformed
    entry's ``ValueError`` or ``AttributeError`` into a `CheckpointError`."""
    if saved is None:
        counts: dict[str, int] = {}
        for report in reports:
            for c in report.accepted:
                counts[c] = counts.get(c, 0) + 1
        return counts
    counts = {str(c): int(v) for c, v in saved.items()}
    if any(v < 0 for v in counts.values()):
        raise ValueError(f"negative participation count in {counts}")
    return counts


def _state(template: Any, ckpt: Checkpoint, prefix: str, what: str) -> Any:
    """The pytree stored under ``<prefix>/<i>`` with ``template``'s structure and leaves'
    shapes, dtypes and kinds (JAX or NumPy arrays); `CheckpointError` naming ``what`` when it
    does not fit."""
    where = f"checkpoint {ckpt.location!r}"
    like, treedef = jax.tree_util.tree_flatten(template)
    saved = ckpt.meta.get(f"{prefix}_structure", str(jax.tree_util.tree_structure(())))
    if str(treedef) != saved:
        raise CheckpointError(
            f"{where}: the state of {what} has another structure; start over with --fresh"
        )
    leaves = []
    for i, leaf in enumerate(like):
        arr = ckpt.tensors.get(f"{prefix}/{i}")
        if arr is None or arr.shape != np.shape(leaf) or arr.dtype != np.asarray(leaf).dtype:
            raise CheckpointError(
                f"{where}: tensor {prefix}/{i} of {what}'s state is missing or misshapen; "
                "start over with --fresh"
            )
        leaves.append(jnp.asarray(arr) if isinstance(leaf, jax.Array) else np.array(arr))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _metadata(blob: bytes, location: str) -> dict[str, Any]:
    """The JSON description in a safetensors header (8-byte length, then a JSON object)."""
    try:
        (size,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8 : 8 + size])
        meta = json.loads(header["__metadata__"][_META])
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{location!r} is not a federated server checkpoint ({exc!r}); point "
            "server.checkpoint elsewhere, or start over with --fresh"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{location!r} is not a {FORMAT!r} checkpoint")
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"{location!r} has checkpoint version {meta.get('version')!r}; this Tandem reads "
            f"version {VERSION}: resume with the Tandem that wrote it, or start over with --fresh"
        )
    return meta


__all__ = ["Checkpoint", "CheckpointError", "encode", "load", "restore", "save"]
