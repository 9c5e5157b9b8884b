"""Writing a party's own files so that a crash never leaves half of one.

`write_atomic` is the one way Tandem replaces a checkpoint, an export or a journal snapshot:
readers see the old content or the new, never a part of either.

* A local path (or ``file://`` URL): the bytes go to a temporary file in the same folder,
  which is flushed and fsynced, then renamed over the target (`os.replace`, atomic on POSIX),
  and the folder is fsynced so the rename itself survives a power cut. Temporary files that a
  killed writer left beside the target are removed first.
* Any other fsspec URL (``memory://``, ``s3://`` with s3fs): the bytes go to a temporary key
  that is then moved onto the target, which object stores publish in one step.
"""

from __future__ import annotations

import os
import secrets
import tempfile

import fsspec


def write_atomic(location: str | os.PathLike[str], blob: bytes) -> None:
    """Replace ``location`` (a path or an fsspec URL) by ``blob`` in one step (module
    docstring); creates the folder if needed."""
    location = os.fspath(location)
    if "://" in location and not location.startswith("file://"):
        fs, path = fsspec.core.url_to_fs(location)
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        if parent:
            fs.makedirs(parent, exist_ok=True)
        tmp = f"{path}.{secrets.token_hex(4)}.tmp"
        fs.pipe_file(tmp, blob)
        fs.mv(tmp, path)
        return
    path = os.path.abspath(location.removeprefix("file://"))
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    prefix = f".{os.path.basename(path)}."
    for stale in os.listdir(folder):  # left by a process killed while writing
        if stale.startswith(prefix) and stale.endswith(".tmp"):
            os.unlink(os.path.join(folder, stale))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def fsync_dir(folder: str) -> None:
    """Make a rename or unlink in ``folder`` durable (a no-op where folders cannot be
    opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
