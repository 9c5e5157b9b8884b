"""Atomic training checkpoints of one party: params, optimizer state, step and data cursor.

Format (no pickle; docs/parties.md#checkpoints): one safetensors file per checkpoint,
``<dir>/step-<step:09d>.safetensors``:

* tensors ``p/<stage>/<i>`` (the i-th leaf of the stage's params pytree, in
  ``jax.tree_util`` flatten order) and ``o/<stage>/<i>`` (optimizer state leaves, likewise);
* header metadata key ``"tandem"``: JSON ``{"format": "tandem-checkpoint", "version": 1,
  "party", "spec_hash", "step", "cursor": {"epoch", "batch"}, "extra": {...},
  "fingerprint": <the party's data fingerprint, or null>, "finished": bool,
  "structure": {"params": {stage: treedef text}, "opt_state": {stage: treedef text}}}``.

**Finished checkpoints.** A job that completed saves one more checkpoint at its final step,
``<dir>/finished-<step:09d>.safetensors``, with ``"finished": true`` (the name and the flag
must agree, or the file is refused as unreadable). It is a periodic checkpoint *and more*:
``p/`` and ``o/`` still hold the training trajectory at that step (so any reader that ignores
the flag resumes correctly), and, where the run ended on other parameters than its last
(``restore_best``), tensors ``b/<stage>/<i>`` hold those (the exported ones; same structure as
``p/``). A file without the key (older ones) is not finished. Invariant: ``b/`` tensors
exist only in a finished file. Where a step has both files (``every`` divides the final
step), the finished one is read. The ``keep`` newest periodic files survive a save, and the
newest finished one.

The pytree *structure* is not stored as code: `CheckpointStore.load` takes templates (the
freshly initialised params and optimizer state) and refills their leaves, after checking that
the number, dtypes and shapes of the leaves and the treedef text agree.

Atomicity: `CheckpointStore.save` writes ``.step-<step>.<random>.tmp`` in the same folder,
fsyncs it, `os.replace`s it onto the final name and fsyncs the folder. A crash at any point
leaves either the old set of checkpoints or the old set plus the new one, never a partial file
under a final name; stray ``.tmp`` files are ignored and removed by the next save. After a
save, only the newest ``keep`` checkpoints remain.

``save``/``load`` do blocking file I/O: call them off the event loop (``asyncio.to_thread``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import safetensors.numpy
from safetensors import safe_open

from tandem.errors import EngineError
from tandem.parties.files import fsync_dir, write_atomic

from .spec import SPEC_VERSION

FORMAT = "tandem-checkpoint"
VERSION = 1
_META = "tandem"
_NAME = re.compile(r"^step-(\d{9})\.safetensors$")
_FINISHED = re.compile(r"^finished-(\d{9})\.safetensors$")


class CheckpointError(EngineError):
    """A checkpoint could not be written or read, or does not fit this party's model."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """A loaded checkpoint: pytrees shaped like the templates, and the metadata."""

    step: int
    params: dict[str, Any]
    opt_state: dict[str, Any]
    cursor: dict[str, int]
    extra: dict[str, Any]
    spec_hash: str
    #: True for the checkpoint a completed job saved at its end (see the module docstring).
    finished: bool = False
    #: A finished run's exported parameters where they differ from ``params`` (best epoch).
    best: dict[str, Any] | None = None


class CheckpointStore:
    """The checkpoints of one party in one folder (created if missing).

    Args:
      directory: where the ``step-*.safetensors`` files live.
      party: this party's name (recorded, and checked on load).
      keep: how many of the newest checkpoints survive a save (>= 1).
    """

    def __init__(self, directory: str | os.PathLike, *, party: str, keep: int = 3) -> None:
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1, got {keep}")
        self.directory = os.fspath(directory)
        self.party = party
        self.keep = keep

    def path(self, step: int) -> str:
        """The periodic checkpoint file of ``step``."""
        return os.path.join(self.directory, f"step-{int(step):09d}.safetensors")

    def finished_path(self, step: int) -> str:
        """The finished checkpoint file of ``step`` (see the module docstring)."""
        return os.path.join(self.directory, f"finished-{int(step):09d}.safetensors")

    def _file(self, step: int) -> str:
        """The file read for ``step``: the finished one where it exists."""
        finished = self.finished_path(step)
        return finished if os.path.exists(finished) else self.path(step)

    # -- listing ---------------------------------------------------------------------------
    def _named(self, pattern: re.Pattern[str]) -> list[int]:
        if not os.path.isdir(self.directory):
            return []
        return sorted(
            int(m.group(1)) for n in os.listdir(self.directory) if (m := pattern.match(n))
        )

    def all_steps(self) -> list[int]:
        """Steps of every complete checkpoint file in the folder (periodic or finished),
        ascending."""
        return sorted(set(self._named(_NAME)) | set(self._named(_FINISHED)))

    def steps(self, spec_hash: str | None = None) -> list[int]:
        """Steps of the readable checkpoints of this party (for ``spec_hash`` if given)."""
        return [
            step
            for step, meta in self._own_metas()
            if spec_hash is None or meta.get("spec_hash") == spec_hash
        ]

    def _own_metas(self) -> list[tuple[int, dict[str, Any]]]:
        """``(step, description)`` of this party's readable checkpoints, ascending."""
        out = []
        for step in self.all_steps():
            try:
                meta = self.read_meta(step)
            except CheckpointError:
                continue
            if meta.get("party") == self.party:
                out.append((step, meta))
        return out

    def index(self) -> dict[int, str]:
        """``{step: spec_hash}`` of this party's readable checkpoints (one pass over the
        folder; lets a caller answer "which steps for hash h?" later without file I/O)."""
        return {step: str(meta.get("spec_hash")) for step, meta in self._own_metas()}

    def finished(self) -> set[int]:
        """Steps of this party's *finished* checkpoints (saved by a job that completed)."""
        return {step for step, meta in self._own_metas() if meta.get("finished") is True}

    def fingerprints(self) -> dict[int, str | None]:
        """``{step: data fingerprint}`` of this party's readable checkpoints (None where the
        checkpoint recorded none)."""
        out: dict[int, str | None] = {}
        for step, meta in self._own_metas():
            value = meta.get("fingerprint")
            out[step] = None if value is None else str(value)
        return out

    def spec_versions(self) -> dict[int, int]:
        """``{step: task-spec version}`` of this party's readable checkpoints (1 where the
        checkpoint predates the field: its spec hashed under version 1)."""
        return {step: int(meta.get("spec_version", 1)) for step, meta in self._own_metas()}

    def discard_after(self, step: int) -> list[int]:
        """Delete the checkpoints newer than ``step`` (after the parties agreed to resume from
        ``step``, a newer checkpoint of this party belongs to a trajectory that is being
        replaced); returns the steps deleted."""
        gone = [s for s in self.all_steps() if s > step]
        for s in gone:
            for path in (self.path(s), self.finished_path(s)):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if gone:
            fsync_dir(self.directory)
        return gone

    def read_meta(self, step: int) -> dict[str, Any]:
        """The description of checkpoint ``step`` (its finished file where there is one);
        `CheckpointError` if it is unreadable, or its flag and name disagree."""
        path = self._file(step)
        try:
            with safe_open(path, framework="np") as f:
                meta = f.metadata() or {}
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint at step {step} in {self.directory!r}") from None
        except Exception as exc:  # SafetensorError
            raise CheckpointError(f"{path!r} is not a readable checkpoint: {exc}") from None
        try:
            desc = json.loads(meta[_META])
        except (KeyError, json.JSONDecodeError):
            raise CheckpointError(f"{path!r} has no Tandem checkpoint description") from None
        if desc.get("format") != FORMAT or desc.get("version") != VERSION:
            raise CheckpointError(f"{path!r} is not a {FORMAT!r} v{VERSION} file")
        if (desc.get("finished") is True) != (path != self.path(step)):
            raise CheckpointError(
                f"{path!r}: its finished flag ({desc.get('finished')!r}) disagrees with its "
                "name; it was renamed by hand: delete it, or start over with --fresh"
            )
        return desc

    # -- writing ---------------------------------------------------------------------------
    def save(
        self,
        step: int,
        *,
        params: Mapping[str, Any],
        opt_state: Mapping[str, Any],
        spec_hash: str,
        cursor: Mapping[str, int],
        extra: Mapping[str, Any] | None = None,
        fingerprint: str | None = None,
        finished: bool = False,
        best: Mapping[str, Any] | None = None,
    ) -> str:
        """Atomically write checkpoint ``step``; returns its path. See the module docstring.
        ``fingerprint``: the party's data fingerprint, recorded so a resume on changed data
        is refused. ``finished``: this is the final checkpoint of a completed job, ``params``
        its trajectory's last parameters and ``best`` (if given) the ones it ended on."""
        import jax

        if best is not None and not finished:
            raise CheckpointError("only a finished checkpoint holds `best` parameters")
        tensors: dict[str, np.ndarray] = {}
        structure: dict[str, dict[str, str]] = {"params": {}, "opt_state": {}}
        groups = [("p", "params", params), ("o", "opt_state", opt_state)]
        if best is not None:
            structure["best"] = {}
            groups.append(("b", "best", best))
        for prefix, key, trees in groups:
            for stage, tree in trees.items():
                if "/" in stage:
                    raise CheckpointError(f"stage name {stage!r} must not contain '/'")
                leaves, treedef = jax.tree_util.tree_flatten(tree)
                structure[key][stage] = str(treedef)
                for i, leaf in enumerate(leaves):
                    arr = np.asarray(leaf)  # (np.ascontiguousarray would make 0-d arrays 1-d)
                    if not arr.flags.c_contiguous:
                        arr = arr.copy(order="C")
                    if arr.dtype.kind not in "biuf":
                        raise CheckpointError(
                            f"{key} leaf {stage}/{i} has dtype {arr.dtype}; "
                            "only numeric arrays can be checkpointed"
                        )
                    tensors[f"{prefix}/{stage}/{i}"] = arr.astype(
                        arr.dtype.newbyteorder("<"), copy=False
                    )
        desc = {
            "format": FORMAT,
            "version": VERSION,
            "party": self.party,
            "spec_hash": spec_hash,
            "step": int(step),
            "cursor": {k: int(v) for k, v in cursor.items()},
            "extra": dict(extra or {}),
            "fingerprint": fingerprint,
            "finished": bool(finished),
            "spec_version": SPEC_VERSION,
            "structure": structure,
        }
        blob = safetensors.numpy.save(tensors, metadata={_META: json.dumps(desc, sort_keys=True)})
        os.makedirs(self.directory, exist_ok=True)
        final = self.finished_path(step) if finished else self.path(step)
        write_atomic(final, blob)
        self._prune()
        return final

    def _prune(self) -> None:
        periodic, finished = self._named(_NAME), self._named(_FINISHED)
        old = [self.path(s) for s in periodic[: -self.keep]]
        old += [self.finished_path(s) for s in finished[:-1]]
        for path in old:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        for name in os.listdir(self.directory):
            if name.startswith((".step-", ".finished-")) and name.endswith(".tmp"):
                try:
                    os.unlink(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass

    # -- reading ---------------------------------------------------------------------------
    def load(
        self,
        step: int,
        *,
        params_like: Mapping[str, Any],
        opt_state_like: Mapping[str, Any],
        spec_hash: str | None = None,
    ) -> Restored:
        """Read checkpoint ``step`` into pytrees shaped like the templates.

        Raises `CheckpointError` naming the leaf when the file's leaves (count, dtype, shape)
        or structure differ from the templates, or its party/spec hash from this one's.
        """
        import jax

        desc = self.read_meta(step)
        path = self._file(step)
        if desc.get("party") != self.party:
            raise CheckpointError(
                f"{path!r} belongs to party {desc.get('party')!r}, not "
                f"{self.party!r}; point checkpoint.dir at this party's folder"
            )
        if spec_hash is not None and desc.get("spec_hash") != spec_hash:
            raise CheckpointError(
                f"{path!r} was saved for task spec {desc.get('spec_hash')!r:.16}"
                f" but the agreed spec is {spec_hash!r:.16}; start over with `tandem party "
                "--config <file> --fresh` on every party, or restore that job's configuration"
            )
        finished = desc.get("finished") is True
        groups = [("p", "params", params_like), ("o", "opt_state", opt_state_like)]
        if "best" in desc["structure"]:
            if not finished:
                raise CheckpointError(f"{path!r} holds best parameters but is not finished")
            groups.append(("b", "best", params_like))
        out: dict[str, dict[str, Any]] = {"params": {}, "opt_state": {}}
        with safe_open(path, framework="np") as f:
            names = set(f.keys())
            for prefix, key, templates in groups:
                out.setdefault(key, {})
                stored = desc["structure"][key]
                if set(stored) != set(templates):
                    raise CheckpointError(
                        f"{path!r} holds {key} of stages {sorted(stored)} but "
                        f"this party has {sorted(templates)}"
                    )
                for stage, template in templates.items():
                    leaves, treedef = jax.tree_util.tree_flatten(template)
                    if str(treedef) != stored[stage]:
                        raise CheckpointError(
                            f"{path!r}: {key} of stage {stage!r} has another structure than this "
                            f"party's model/optimizer (saved {stored[stage][:120]}, now "
                            f"{str(treedef)[:120]})"
                        )
                    filled = []
                    for i, leaf in enumerate(leaves):
                        name = f"{prefix}/{stage}/{i}"
                        if name not in names:
                            raise CheckpointError(f"{path!r} lacks tensor {name!r}")
                        arr = f.get_tensor(name)
                        want = np.asarray(leaf)
                        if arr.dtype != want.dtype or arr.shape != want.shape:
                            raise CheckpointError(
                                f"{path!r}: {name} is {arr.dtype}{list(arr.shape)} but this "
                                f"party's model needs {want.dtype}{list(want.shape)}; the file "
                                "does not fit this model: delete it (every party's file of "
                                "that step) or point checkpoint.dir elsewhere"
                            )
                        filled.append(arr)
                    out[key][stage] = jax.tree_util.tree_unflatten(treedef, filled)
        return Restored(
            step=int(desc["step"]),
            params=out["params"],
            opt_state=out["opt_state"],
            cursor=dict(desc.get("cursor", {})),
            extra=dict(desc.get("extra", {})),
            spec_hash=str(desc.get("spec_hash")),
            finished=finished,
            best=out.get("best"),
        )


__all__ = ["CheckpointStore", "CheckpointError", "Restored"]
