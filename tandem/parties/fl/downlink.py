"""Sparse downlink: what the server sends so a client rebuilds the server's model exactly.

A delta message carries ``(indices, values)`` where ``values = model_v[indices]`` (the new
values themselves, not differences) and ``indices`` covers every coordinate changed since a
``base`` version. Applying it to a client model of *any* version ``u`` with
``base <= u <= v`` gives ``model_v`` bit for bit: a coordinate outside ``indices`` did not
change between ``base`` and ``v``, hence not between ``u`` and ``v`` either. So exactness
needs no float arithmetic on the client, and the server only needs a lower bound on the
client's version (the version the client reported with its last accepted update).

Modes (`DownlinkPlanner.mode`):

* ``"full"``: always the whole model (dense FedAvg).
* ``"initial"``: delta against the initial model (every client can build it from the shared
  init seed), i.e. all coordinates touched so far.
* ``"version"``: delta against the version the client last confirmed; the server keeps a
  bounded log (``log_size`` versions) of changed index sets; a client further behind, or
  unknown, gets the full model.
* ``"anchor"``: every ``anchor_every`` rounds the full model is broadcast to every client; in
  between, deltas against the latest anchor.

In every mode a delta that would be larger than the full model is replaced by the full model.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import numpy as np

from tandem.errors import ConfigError

from .protocol import DownlinkError

MODES = ("full", "initial", "version", "anchor")


def index_dtype(d: int) -> np.dtype:
    """Smallest unsigned integer type that can index ``d`` coordinates."""
    return np.dtype(np.uint16) if d <= 1 << 16 else np.dtype(np.uint32)


class DownlinkPlanner:
    """Server side: tracks which coordinates changed at each version and plans messages.

    Invariant: for every version ``b`` the planner can still serve, ``changed_since(b)`` is a
    superset of the coordinates where ``model_b`` and the current model differ.
    """

    def __init__(
        self, d: int, mode: str = "version", *, log_size: int = 16, anchor_every: int = 10
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"downlink mode {mode!r} is not one of {MODES}")
        if log_size < 1 or anchor_every < 1:
            raise ConfigError(
                f"log_size and anchor_every must be >= 1, got {log_size}, {anchor_every}"
            )
        self.d, self.mode = d, mode
        self.log_size, self.anchor_every = log_size, anchor_every
        self.version = 0
        self._log: collections.deque[tuple[int, np.ndarray | None]] = collections.deque(
            maxlen=log_size
        )
        self._since_init = np.zeros(d, bool)
        self._since_anchor = np.zeros(d, bool)
        self.anchor_version = 0
        self._idx_dtype = index_dtype(d)

    def record(self, indices: np.ndarray | None) -> int:
        """Register one server update (``None`` = every coordinate); returns the new version."""
        self.version += 1
        self._log.append((self.version, None if indices is None else np.asarray(indices)))
        for mask in (self._since_init, self._since_anchor):
            if indices is None:
                mask[:] = True
            else:
                mask[indices] = True
        return self.version

    def state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Everything `restore` needs, as arrays and JSON data (for a checkpoint)."""
        arrays = {
            "since_init": self._since_init.astype(np.uint8),
            "since_anchor": self._since_anchor.astype(np.uint8),
        }
        log = []
        for ver, idx in self._log:
            log.append([ver, idx is not None])
            if idx is not None:
                arrays[f"log/{ver}"] = np.asarray(idx, np.int64)
        meta = {"version": self.version, "anchor_version": self.anchor_version, "log": log}
        return arrays, meta

    def restore(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """Take back a `state`; raises `ConfigError` when it does not fit this planner."""
        try:
            since_init = np.asarray(arrays["since_init"]) != 0
            since_anchor = np.asarray(arrays["since_anchor"]) != 0
            version, anchor = int(meta["version"]), int(meta["anchor_version"])
            log = [
                (int(ver), np.asarray(arrays[f"log/{ver}"]) if has else None)
                for ver, has in meta["log"]
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"downlink state is incomplete or malformed: {exc!r}") from None
        if since_init.shape != (self.d,) or since_anchor.shape != (self.d,):
            raise ConfigError(
                f"downlink state is for {since_init.shape} coordinates, this model has {self.d}"
            )
        if len(log) > self.log_size or any(
            i is not None and i.size and (i.min() < 0 or i.max() >= self.d) for _, i in log
        ):
            raise ConfigError("downlink state's version log does not fit this planner")
        self._since_init, self._since_anchor = since_init, since_anchor
        self.version, self.anchor_version = version, anchor
        self._log.clear()
        self._log.extend(log)

    def anchor_due(self) -> bool:
        """True when the current version starts a new anchor period (broadcast it now)."""
        return (
            self.mode == "anchor"
            and self.version % self.anchor_every == 0
            and self.version != self.anchor_version
        )

    def set_anchor(self) -> None:
        self.anchor_version = self.version
        self._since_anchor[:] = False

    def changed_since(self, base: int) -> np.ndarray | None:
        """Sorted indices changed after ``base``, or None when unknown (log evicted)."""
        if base == self.version:
            return np.zeros(0, np.int64)
        if base == 0 and self.mode == "initial":
            return np.flatnonzero(self._since_init)
        if base == self.anchor_version and self.mode == "anchor":
            return np.flatnonzero(self._since_anchor)
        if not self._log or base < self._log[0][0] - 1:
            return None
        parts = []
        for ver, idx in self._log:
            if ver > base:
                if idx is None:
                    return None
                parts.append(idx)
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

    def plan(self, model: np.ndarray, client_version: int | None) -> tuple[dict[str, Any], tuple]:
        """The message for a client known to hold at least ``client_version`` (None: unknown).

        Returns ``(meta, arrays)``; meta has ``kind`` (``full``/``delta``), ``version`` and
        for deltas ``base``.
        """
        full = ({"kind": "full", "version": self.version}, (model,))
        if self.mode == "full" or client_version is None:
            return full
        if self.mode == "initial":
            client_version = max(client_version, 0)
        base = {"initial": 0, "anchor": self.anchor_version}.get(self.mode, client_version)
        if client_version < base:
            return full
        idx = self.changed_since(base)
        if idx is None or idx.size * (self._idx_dtype.itemsize + 4) >= model.nbytes:
            return full
        return (
            {"kind": "delta", "version": self.version, "base": base},
            (idx.astype(self._idx_dtype), model[idx]),
        )


class ClientModel:
    """Client side: the last server model received and its version.

    `apply` raises `DownlinkError` if a delta's base is newer than what this client holds
    (the server never plans that), leaving the state unchanged.

    Invariant: ``model`` is read-only and never written in place (a delta builds a new
    array), so it holds a model without copying it: a read-only initial model as given (a
    trainer's ``init_vec``), a full model as received (a received frame's arrays are the
    receiver's own: every transport copies them or receives into a buffer of its own, unless
    a `tandem.transports.memory.MemoryNetwork` is built with ``copy=False``). Each copy
    avoided is the model's size off a client's peak memory.
    """

    def __init__(self, initial: np.ndarray) -> None:
        self.model = _read_only(initial, copy=initial.flags.writeable)
        self.version = 0

    def apply(self, meta: Mapping[str, Any], arrays: tuple[np.ndarray, ...]) -> np.ndarray:
        kind, version = meta.get("kind"), meta.get("version")
        if not isinstance(version, int) or version < self.version:
            raise DownlinkError(
                f"model version {version!r} is older than the held version {self.version}"
            )
        if kind == "full":
            (model,) = arrays
            if model.shape != self.model.shape or model.dtype != np.float32:
                raise DownlinkError(
                    f"full model must be float32 {self.model.shape}, got "
                    f"{model.dtype} {model.shape}"
                )
            self.model = _read_only(model, copy=False)
        elif kind == "delta":
            base = meta.get("base")
            if not isinstance(base, int) or base > self.version:
                raise DownlinkError(
                    f"delta against version {base!r} cannot apply to held version "
                    f"{self.version}; the server must send the full model"
                )
            idx, values = arrays
            if idx.shape != values.shape or (idx.size and int(idx.max()) >= self.model.size):
                raise DownlinkError(
                    "delta indices and values differ in shape or index past the model's end"
                )
            model = self.model.copy()
            model[idx.astype(np.int64)] = values
            self.model = _read_only(model, copy=False)
        else:
            raise DownlinkError(f"unknown model message kind {kind!r}")
        self.version = version
        return self.model


def _read_only(model: np.ndarray, *, copy: bool) -> np.ndarray:
    """``model`` as float32 (a copy when ``copy`` or another dtype), in a read-only view."""
    view = np.array(model, np.float32, copy=True) if copy else np.asarray(model, np.float32)
    view = view.view()
    view.flags.writeable = False
    return view
