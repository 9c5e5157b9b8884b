"""JAX's persistent compilation cache for a role process (split learning's ``[checkpoint]
compile_cache``, elastic training's ``[ray] compile_cache``).

A party's kernels are compiled at their first call in each process; with the cache, XLA's
executables are kept in a folder and a restarted (resumed) party, or any later process with
the same folder, loads them instead of compiling again. Only a process layer calls
`enable_compile_cache` (the ``tandem party`` command; a Ray actor of ``tandem elastic launch``),
before its first compilation: JAX reads the setting once per process, at the first
compilation, and the library itself never changes a process-wide setting.

``compile_cache``: ``true`` (the default) is the folder ``compile-cache`` in the checkpoint
folder (else in the export folder, else no cache) unless the environment already names one
(``JAX_COMPILATION_CACHE_DIR``, which then wins); a string is a folder (relative to the TOML
file); ``false`` turns the cache off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: The default cache folder's name, beside the checkpoints (in the checkpoint folder).
FOLDER = "compile-cache"
_ENV = "JAX_COMPILATION_CACHE_DIR"


def compile_cache_folder(
    setting: bool | str,
    checkpoint_dir: str | None,
    export_dir: str | None,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The folder a party process caches its compiled kernels in, or None for no cache (the
    rules in the module docstring). Pure: reads only its arguments."""
    environ = os.environ if environ is None else environ
    if setting is False:
        return None
    if isinstance(setting, str):
        return setting
    if environ.get(_ENV):
        return environ[_ENV]
    home = checkpoint_dir or export_dir
    return None if home is None else os.path.join(home, FOLDER)


def enable_compile_cache(folder: str | None) -> None:
    """Point this process's JAX at ``folder`` (None: turn the cache off). Every kernel is
    cached, however quick its compile (JAX's defaults skip those under a second, which on a
    restart still add up), unless the environment sets those thresholds itself. Call it
    before the process's first compilation."""
    import jax

    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", folder)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


__all__ = ["FOLDER", "compile_cache_folder", "enable_compile_cache"]
