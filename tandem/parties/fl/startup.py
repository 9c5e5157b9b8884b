"""Start-up of a federated process: JAX's persistent compilation cache, and pyarrow's allocator.

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

pyarrow's allocator (`use_system_arrow_pool`): a federated process reads one small table, and
pyarrow's default pool (mimalloc) keeps its arenas reserved for the life of the process, about
10 MB of each client's peak RSS. The process entry points make pyarrow use the C library's
``malloc`` instead unless the environment already names a pool (``ARROW_DEFAULT_MEMORY_POOL``,
pyarrow's own variable: ``system``, ``mimalloc`` or ``jemalloc``).
"""

from __future__ import annotations

import logging
import os
import sys

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


#: pyarrow's variable naming its default memory pool, read at its first allocation.
ARROW_POOL_ENV = "ARROW_DEFAULT_MEMORY_POOL"


def use_system_arrow_pool() -> str:
    """Make pyarrow allocate with the C library's ``malloc`` in this process unless
    ``ARROW_DEFAULT_MEMORY_POOL`` names a pool already (module docstring); returns the pool's
    name. Call before pyarrow reads data; if pyarrow is already imported its default pool is
    switched too (pyarrow then reads the variable no more)."""
    pool = os.environ.setdefault(ARROW_POOL_ENV, "system")
    if pool == "system" and "pyarrow" in sys.modules:
        import pyarrow as pa

        pa.set_memory_pool(pa.system_memory_pool())
    return pool


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
