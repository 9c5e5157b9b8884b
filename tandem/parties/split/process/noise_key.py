"""A party's secret noise key, kept beside its checkpoints so that a resumed run draws the
same privacy noise.

The noise of the privacy defenses is keyed by the negotiated ``[privacy] seed``, which every
peer knows, and by the party's own ``[privacy] noise_seed``, which no peer may know
(`tandem.parties.privacy.noise`). Left unset, a process draws a fresh one at every start: a
party restarted from a checkpoint would then randomize its labels again (label DP) and send
the rows of the steps it re-runs with new noise, spending more than the epsilon reported.

So a `tandem party` with a ``[checkpoint] dir``, defenses that draw noise and no
``noise_seed`` of its own takes `noise_seed` from a random key kept in that folder,
``<party>.noise-key`` (32 random bytes as hex, written once, mode 0600: as secret as the
data), hashed with the task's spec hash. The same job resumed draws the same noise; a job
with another spec (other data, settings or models) draws other noise from the same key, so no
two jobs share noise; ``--fresh`` deletes the key with the checkpoints. The key never leaves
the party.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets

from ...privacy.config import Privacy
from ..checkpoint import CheckpointError

#: the key file's name beside the checkpoints: ``<party>.noise-key``
SUFFIX = ".noise-key"


def draws_noise(privacy: Privacy) -> bool:
    """Whether any defense of ``privacy`` draws randomness keyed by the party's secret."""
    return any(
        table is not None
        for table in (
            privacy.label_dp,
            privacy.gradient_alignment,
            privacy.gradient_dp,
            privacy.activation_dp,
        )
    )


def key_path(folder: str, party: str) -> str:
    """Where ``party`` keeps its key in ``folder``."""
    return os.path.join(folder, f"{party}{SUFFIX}")


def noise_seed(folder: str, party: str, spec_hash: str) -> int:
    """``party``'s ``noise_seed`` for the task of ``spec_hash``: its key in ``folder``
    (created on first use) hashed with the spec hash, 64 bits; `CheckpointError` when the
    file holds no key. Blocking file I/O."""
    path = key_path(folder, party)
    os.makedirs(folder, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
    with open(path, encoding="ascii") as f:
        text = f.read().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise CheckpointError(
            f"{path!r} is not a noise key (64 hex digits); delete it to draw a new one (the "
            "noise of a resumed run then differs from the checkpointed one's), or start over "
            "with `tandem party --config <file> --fresh`"
        )
    digest = hashlib.sha256(key + spec_hash.encode("ascii")).digest()
    return int.from_bytes(digest[:8], "big")


def discard(folder: str, party: str) -> None:
    """Delete ``party``'s key in ``folder`` (``--fresh``: a new job draws a new key)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(key_path(folder, party))


def party_privacy(privacy: Privacy, folder: str | None, party: str, spec_hash: str) -> Privacy:
    """``privacy`` with its ``noise_seed`` taken from the key in ``folder`` (the checkpoint
    folder) where it draws noise and states none of its own; else ``privacy`` unchanged."""
    if folder is None or privacy.noise_seed is not None or not draws_noise(privacy):
        return privacy
    seed = noise_seed(folder, party, spec_hash)
    return privacy.model_copy(update={"noise_seed": seed})


__all__ = ["SUFFIX", "discard", "draws_noise", "key_path", "noise_seed", "party_privacy"]
