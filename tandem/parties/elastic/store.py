"""Durable parameter-server checkpoints behind an fsspec URL (a local folder, ``memory://``,
``s3://`` with s3fs installed): safetensors for the arrays, JSON for the metadata, never pickle.

Layout under the store's URL::

    ckpt-00000007.safetensors   arrays "leaf/0" ... "leaf/N", "counts"; header metadata
                                "tandem-elastic": JSON {seq, generation, epoch, offset,
                                n_batches, spec, digest, leaves, shapes}
    LATEST                      JSON {"seq": 7, "file": "ckpt-00000007.safetensors", "digest"}

Atomicity: every file is written with `tandem.parties.files.write_atomic` (on a local file
system a temporary name, ``fsync``, a rename and a synced folder; on an object store a temporary
key moved into place), the checkpoint first and the small ``LATEST`` manifest after it. A
reader therefore sees a checkpoint whole or not at all, and ``LATEST`` never names one that is
missing.

Checkpoints are addressed by sequence number (``seq``), which the coordinator assigns and
records in its journal; `CheckpointStore.load` reads exactly the one asked for, so a data server
restarted after ``kill -9`` returns to the state the coordinator committed, not merely to the
newest file it finds. `CheckpointStore.prune` removes checkpoints older than a given seq.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec
import numpy as np
import safetensors.numpy
from safetensors import SafetensorError

from tandem.parties.files import write_atomic

from .errors import CheckpointError

_META_KEY = "tandem-elastic"
_NAME = re.compile(r"ckpt-(\d{8})\.safetensors$")
MANIFEST = "LATEST"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One stored parameter-server state: ``leaves`` (parameters then optimizer-state leaves),
    ``counts`` (applications per local batch of the epoch) and the JSON ``meta``."""

    seq: int
    leaves: list[np.ndarray]
    counts: np.ndarray
    meta: dict[str, Any]


class CheckpointStore:
    """The checkpoints of one parameter server under ``url`` (module docstring)."""

    def __init__(self, url: str) -> None:
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
            self.fs.makedirs(self.root, exist_ok=True)
        except (ValueError, ImportError, OSError) as exc:
            raise CheckpointError(
                f"cannot open the checkpoint location {url!r} with fsspec: {exc}; give a local "
                "folder, memory://..., or s3://... (pip install s3fs)"
            ) from None
        self.url = url

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    @staticmethod
    def filename(seq: int) -> str:
        return f"ckpt-{seq:08d}.safetensors"

    def save(
        self,
        seq: int,
        leaves: Sequence[np.ndarray],
        counts: np.ndarray,
        meta: Mapping[str, Any],
    ) -> None:
        """Store checkpoint ``seq`` atomically, then publish it in the manifest."""
        tensors = {f"leaf/{i}": np.ascontiguousarray(a) for i, a in enumerate(leaves)}
        tensors["counts"] = np.ascontiguousarray(counts)
        # safetensors stores a 0-d array as shape [1]; the metadata keeps the true shapes
        shapes = [list(np.shape(a)) for a in leaves]
        full = {**meta, "seq": int(seq), "leaves": len(leaves), "shapes": shapes}
        blob = safetensors.numpy.save(tensors, metadata={_META_KEY: json.dumps(full)})
        name = self.filename(seq)
        try:
            write_atomic(self.fs.unstrip_protocol(self._path(name)), blob)
            manifest = {"seq": int(seq), "file": name, "digest": meta.get("digest")}
            write_atomic(
                self.fs.unstrip_protocol(self._path(MANIFEST)), json.dumps(manifest).encode()
            )
        except OSError as exc:
            raise CheckpointError(
                f"cannot write checkpoint {seq} to {self.url!r}: {exc}; check that the "
                "location is writable and has space"
            ) from None

    def load(self, seq: int) -> Checkpoint:
        """Checkpoint ``seq`` exactly; `CheckpointError` naming the file when it is missing or
        damaged."""
        name = self.filename(seq)
        try:
            blob = self.fs.cat_file(self._path(name))
        except FileNotFoundError:
            have = self.sequences()
            raise CheckpointError(
                f"checkpoint {seq} is not in {self.url!r} (it holds {have or 'none'}): the "
                "coordinator's journal and this data server's checkpoints come from different "
                "runs, or the folder was cleaned; point both at the same run's files"
            ) from None
        try:
            tensors = safetensors.numpy.load(blob)
            meta = json.loads(_metadata(blob)[_META_KEY])
            leaves = [
                tensors[f"leaf/{i}"].reshape(meta["shapes"][i]) for i in range(int(meta["leaves"]))
            ]
            counts = tensors["counts"]
        except (SafetensorError, KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(
                f"{self.url!r}/{name} is not a readable elastic checkpoint ({exc}); delete it and "
                "restart from the previous one"
            ) from None
        return Checkpoint(seq=int(seq), leaves=leaves, counts=counts, meta=meta)

    def latest(self) -> int | None:
        """The seq the manifest names (None when nothing was stored)."""
        try:
            return int(json.loads(self.fs.cat_file(self._path(MANIFEST)))["seq"])
        except FileNotFoundError:
            return None

    def sequences(self) -> list[int]:
        """The seqs stored, ascending."""
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        found = (_NAME.search(str(n)) for n in names)
        return sorted(int(m.group(1)) for m in found if m)

    def prune(self, keep_from: int) -> None:
        """Delete checkpoints older than ``keep_from`` (best effort: a leftover costs space)."""
        for seq in self.sequences():
            if seq < keep_from:
                try:
                    self.fs.rm_file(self._path(self.filename(seq)))
                except OSError:
                    pass


def _metadata(blob: bytes) -> dict[str, str]:
    """The header metadata of a safetensors blob (the format: 8-byte little-endian header
    length, then the JSON header)."""
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    meta = header.get("__metadata__") or {}
    if _META_KEY not in meta:
        raise KeyError(f"no {_META_KEY!r} metadata")
    return meta
