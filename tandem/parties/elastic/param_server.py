"""The parameter server hosted by each data server: parameters, optimizer state, the count of
applications per batch of the current epoch, and the last checkpoint. Synchronous and free of
asyncio; its JAX step is called by the data server through ``asyncio.to_thread`` under a lock.

Invariants:

* ``generation`` never decreases; `apply` refuses results of any other generation
  (`StaleGenerationError`), so results of fenced work never reach the parameters.
* ``counts[i]`` is how many times local batch ``i`` is reflected in the parameters in this
  epoch; `apply` refuses to raise a count above 1 (a second application is a bug upstream).
  ``counts`` is checkpointed and rolled back together with the parameters.
* After `rollback`, the state is bit-identical to the last checkpoint (`digest` equal).
* The checkpoint owns private copies: nothing applied later can alias it.
* With a `CheckpointStore`, `checkpoint(seq)` also writes the state durably as checkpoint
  ``seq`` before it returns, and `restore(seq, generation)` returns to exactly that state
  (bit-identical, whether it comes from memory or from the store), e.g. in a process
  restarted after ``kill -9``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from . import kernels as K
from .errors import CheckpointError, LedgerError, ProtocolError, StaleGenerationError
from .spec import ModelSpec
from .store import CheckpointStore


def _sha(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _copy(tree):
    return jax.tree_util.tree_map(lambda a: np.array(a, copy=True), tree)


class ParamServer:
    def __init__(
        self,
        spec: ModelSpec,
        n_batches: int,
        *,
        offset: int = 0,
        store: CheckpointStore | None = None,
        fingerprint: str | None = None,
    ) -> None:
        self.spec = spec
        self.offset = offset
        self.store = store
        self.fingerprint = fingerprint  # of the shard's data (recorded in each checkpoint)
        self.seq: int | None = None  # the durable checkpoint the in-memory one equals
        self.generation = 0
        self.epoch = 0
        self.net = K.net_for(spec)
        self.params = self.net.init_leaves(spec.seed)
        self.state = K.init_state(spec.optimizer, spec.lr, self.params)
        self.counts = np.zeros(n_batches, np.int32)
        self.applied: list[int] = []  # global ids applied since the last checkpoint
        self._shapes = [tuple(p.shape) for p in self.params]
        # (params, optimizer state, counts); `checkpoint` sets it before __init__ returns
        self._ckpt: tuple[list[np.ndarray], Any, np.ndarray]
        self.checkpoint()

    # -- state -----------------------------------------------------------------------------
    def leaves(self) -> list[np.ndarray]:
        """Parameters then optimizer-state leaves (the replica state that is merged)."""
        return list(self.params) + [np.asarray(a) for a in jax.tree_util.tree_leaves(self.state)]

    def load(self, leaves: Sequence[np.ndarray]) -> None:
        """Replace parameters and optimizer state by ``leaves`` (same layout as `leaves`)."""
        mine = self.leaves()
        if len(leaves) != len(mine) or any(
            a.shape != b.shape or a.dtype != b.dtype for a, b in zip(leaves, mine, strict=True)
        ):
            raise ProtocolError(
                "merged state does not match this parameter server's layout "
                f"({len(mine)} leaves); all data servers must share one model"
            )
        n = len(self.params)
        self.params = [np.array(a, copy=True) for a in leaves[:n]]
        treedef = jax.tree_util.tree_structure(self.state)
        self.state = jax.tree_util.tree_unflatten(
            treedef, [np.array(a, copy=True) for a in leaves[n:]]
        )

    def digest(self) -> str:
        """SHA-256 over every byte of parameters, optimizer state and counts."""
        return _sha(self.leaves() + [self.counts])

    def model_digest(self) -> str:
        """SHA-256 of parameters and optimizer state (equal across consistent replicas)."""
        return _sha(self.leaves())

    # -- transitions -----------------------------------------------------------------------
    def apply(self, batch_id: int, generation: int, grads: Sequence[np.ndarray]) -> None:
        """Apply one batch's gradient with the optimizer."""
        if generation != self.generation:
            raise StaleGenerationError(
                f"result for batch {batch_id} is stamped generation {generation}, the parameter "
                f"server is at {self.generation}; refused (the batch is re-issued)"
            )
        i = batch_id - self.offset
        if not 0 <= i < len(self.counts):
            raise ProtocolError(
                f"batch {batch_id} does not belong to this shard (ids "
                f"{self.offset}..{self.offset + len(self.counts) - 1})"
            )
        if self.counts[i]:
            raise LedgerError(
                f"batch {batch_id} is already reflected in the parameters of "
                f"epoch {self.epoch}; refusing to apply it twice"
            )
        if len(grads) != len(self._shapes) or any(
            tuple(g.shape) != s or g.dtype != d
            for g, s, d in zip(grads, self._shapes, self.net.dtypes, strict=True)
        ):
            got = [(tuple(g.shape), str(g.dtype)) for g in grads]
            want = [(s, str(d)) for s, d in zip(self._shapes, self.net.dtypes, strict=True)]
            raise ProtocolError(f"gradient layout {got} does not match the model's {want}")
        if not all(np.isfinite(g).all() for g in grads):
            raise ProtocolError(f"gradient of batch {batch_id} contains NaN or Inf; refused")
        self.params, self.state = K.apply_update(
            self.spec.optimizer, self.spec.lr, self.params, self.state, grads
        )
        self.counts[i] += 1
        self.applied.append(batch_id)

    def fence(self, generation: int) -> list[int]:
        """Move to ``generation`` (refusing older results from now) and return the ids applied
        since the last checkpoint."""
        if generation < self.generation:
            raise StaleGenerationError(
                f"cannot fence back to generation {generation} from {self.generation}"
            )
        self.generation = generation
        return list(self.applied)

    def checkpoint(self, seq: int | None = None) -> str:
        """Make the current state the rollback point; returns its digest. With a store and a
        ``seq``, the state is also written durably as checkpoint ``seq`` (and checkpoints older
        than ``seq - 1`` are pruned: the coordinator's journal names ``seq - 1`` or later)."""
        self._ckpt = (_copy(self.params), _copy(self.state), self.counts.copy())
        self.applied = []
        digest = self.digest()
        if seq is not None and self.store is not None:
            meta = {
                "generation": self.generation,
                "epoch": self.epoch,
                "offset": self.offset,
                "n_batches": len(self.counts),
                "spec": self.spec.digest,
                "fingerprint": self.fingerprint,
                "digest": digest,
            }
            self.store.save(seq, self.leaves(), self.counts, meta)
            self.store.prune(seq - 1)
        self.seq = seq
        return digest

    def restore(self, seq: int, generation: int) -> str:
        """Return to checkpoint ``seq`` at ``generation`` (from memory when the last checkpoint
        is ``seq``, else from the store); returns the digest."""
        if self.seq == seq:
            return self.rollback(generation)
        if self.store is None:
            raise CheckpointError(
                f"checkpoint {seq} is not this parameter server's last one ({self.seq}) and it "
                "has no durable store; give the data server a checkpoints URL so that it can "
                "restart"
            )
        ck = self.store.load(seq)
        if ck.meta.get("spec") != self.spec.digest or ck.meta.get("offset") != self.offset:
            raise CheckpointError(
                f"checkpoint {seq} in {self.store.url!r} belongs to another model or shard "
                f"(spec {ck.meta.get('spec')}, offset {ck.meta.get('offset')}; this server has "
                f"{self.spec.digest}, {self.offset}); give each data server its own folder"
            )
        if ck.meta.get("fingerprint") != self.fingerprint:
            raise CheckpointError(
                f"checkpoint {seq} in {self.store.url!r} was trained on other data (fingerprint "
                f"{ck.meta.get('fingerprint')}, this data server's is {self.fingerprint}); "
                "restart it with the data it was trained on"
            )
        self.fence(generation)
        self.load(ck.leaves)
        self.counts = np.array(ck.counts, np.int32, copy=True)
        self.epoch = int(ck.meta["epoch"])
        self._ckpt = (_copy(self.params), _copy(self.state), self.counts.copy())
        self.applied = []
        self.seq = seq
        digest = self.digest()
        if digest != ck.meta.get("digest"):
            raise CheckpointError(
                f"checkpoint {seq} in {self.store.url!r} does not match its recorded digest; "
                "the file is damaged"
            )
        return digest

    def rollback(self, generation: int) -> str:
        """Restore the last checkpoint and move to ``generation``; returns the digest."""
        self.fence(generation)
        params, state, counts = self._ckpt
        self.params, self.state, self.counts = _copy(params), _copy(state), counts.copy()
        self.applied = []
        return self.digest()

    def new_epoch(self, n_batches: int, seq: int | None = None) -> None:
        """Close the epoch: every batch must be reflected exactly once (else `LedgerError`)."""
        if self.applied:
            raise LedgerError("checkpoint before closing an epoch")
        if not (self.counts == 1).all():
            bad = {int(i) + self.offset: int(c) for i, c in enumerate(self.counts) if c != 1}
            raise LedgerError(
                f"epoch {self.epoch} closes with batches not applied exactly "
                f"once (global id: count): {bad}"
            )
        self.epoch += 1
        self.counts = np.zeros(n_batches, np.int32)
        self.checkpoint(seq)

    def loss(self, x: np.ndarray, y: np.ndarray) -> float:
        return self.net.loss(self.params, x, y)

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float | None:
        return self.net.accuracy(self.params, x, y)
