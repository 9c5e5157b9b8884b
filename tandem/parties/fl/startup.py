"""Start-up of a federated process: JAX's persistent compilation cache.

Every client of a federation compiles the same local training step (one model shape, one
batch size), and so does every restart. With the cache on, the first process on a machine
compiles and writes the executables to a folder; the others load them instead of compiling
(JAX keys each entry by the computation, the backend and the JAX version, so a stale entry is
never used).

``compile_cache`` (``[server]`` and ``[client]``): ``"auto"`` (the default) is
``$TANDEM_COMPILE_CACHE`` or else ``$XDG_CACHE_HOME/tandem/jax`` (``~/.cache/tandem/jax``);
``"off"`` leaves JAX's setting alone; anything else is the folder. It is a process-wide JAX
setting, so only the process entry points (``tandem fl server|client``) call
`enable_compilation_cache`; the library functions never change it.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def cache_folder(setting: str) -> str | None:
    """The folder ``setting`` names (see the module docstring), or None for ``"off"``."""
    if setting == "off":
        return None
    if setting != "auto":
        return os.path.expanduser(setting)
    named = os.environ.get("TANDEM_COMPILE_CACHE")
    if named:
        return None if named == "off" else os.path.expanduser(named)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tandem", "jax")


def enable_compilation_cache(setting: str) -> str | None:
    """Point JAX's persistent compilation cache at ``setting``'s folder (created if needed)
    and cache every compiled step, however fast it compiled; returns the folder, or None
    when ``"off"`` or when the folder cannot be created (a warning says why; compiling
    still works, uncached)."""
    folder = cache_folder(setting)
    if folder is None:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        log.warning(
            "cannot create the compilation cache folder %r (%s); compiling without it "
            '(set compile_cache to a writable folder, or "off")',
            folder,
            exc,
        )
        return None
    from tandem.parties.compile_cache import enable_compile_cache

    enable_compile_cache(folder)
    return folder
