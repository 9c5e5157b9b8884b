"""JAX's persistent compilation cache for a role's process: a ``tandem party``
(``[checkpoint] compile_cache``), an FL server or client (``server.compile_cache``,
``client.compile_cache``), an elastic data server or worker (``compile_cache``).

A role's kernels are compiled at their first call in each process; with the cache, XLA's
executables are kept in a folder and a restarted (resumed) role, or any later process with
the same folder, loads them instead of compiling again. Only the process layer calls
`enable_compile_cache` (each role's command, before its first compilation): JAX reads the
setting once per process, at the first compilation, and the library itself never changes a
process-wide setting.

The setting: ``true`` (the default) is the folder ``compile-cache`` in the role's first local
home (a ``tandem party``: its checkpoint folder, else its export folder, else no cache; the
other roles: `role_homes`) unless the environment already names one
(``JAX_COMPILATION_CACHE_DIR``, which then wins); a string is a folder; ``false`` turns the
cache off. An empty string is refused (`check_setting`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

#: The default cache folder's name, in the role's home folder (beside its checkpoints).
FOLDER = "compile-cache"
_ENV = "JAX_COMPILATION_CACHE_DIR"

#: The help text of every role's ``compile_cache`` key.
DESCRIPTION = (
    "compiled-kernel cache: true (a folder beside the checkpoints), a folder, or false (off)"
)


def compile_cache_folder(
    setting: bool | str,
    checkpoint_dir: str | None,
    export_dir: str | None,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The folder a ``tandem party`` caches its compiled kernels in, or None for no cache
    (the rules in the module docstring). Pure: reads only its arguments."""
    return cache_folder(setting, (checkpoint_dir, export_dir), environ)


def cache_folder(
    setting: bool | str,
    homes: Sequence[str | None],
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The cache folder for ``setting``: a named folder as is, ``false`` None, ``true`` the
    environment's folder, else ``compile-cache`` in the first home that is not None (no home:
    None). Pure: reads only its arguments (``environ`` None: ``os.environ``)."""
    environ = os.environ if environ is None else environ
    if setting is False:
        return None
    if isinstance(setting, str):
        return setting
    if environ.get(_ENV):
        return environ[_ENV]
    home = next((h for h in homes if h is not None), None)
    return None if home is None else os.path.join(home, FOLDER)


def local_folder(location: str | None, *, is_file: bool) -> str | None:
    """The local folder of ``location`` (a path, or a ``file://`` URL): the folder itself, or
    for a file its parent; None for None or another file system's URL (a cache must be a
    local folder)."""
    if location is None:
        return None
    if location.startswith("file://"):
        location = location.removeprefix("file://")
    elif "://" in location:
        return None
    return os.path.dirname(os.path.abspath(location)) if is_file else location


def role_homes(
    checkpoint: str | None, export: str | None, config: str, *, checkpoint_is_file: bool
) -> tuple[str | None, ...]:
    """The homes of an FL or elastic role, in order: its checkpoint's local folder, its
    export's, then its TOML file's (a role without files of its own, as a client or a worker,
    keeps its cache beside its configuration)."""
    return (
        local_folder(checkpoint, is_file=checkpoint_is_file),
        local_folder(export, is_file=True),
        local_folder(config, is_file=True),
    )


def check_setting(value: bool | str, base: str) -> bool | str:
    """A checked ``compile_cache`` value: a folder is resolved against ``base`` (the folder
    relative paths start at); an empty string raises `ValueError` with the fix."""
    if isinstance(value, str):
        if not value:
            raise ValueError("is empty; give a folder, true (the default folder) or false")
        return os.path.join(base, value)
    return value


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


__all__ = [
    "DESCRIPTION",
    "FOLDER",
    "cache_folder",
    "check_setting",
    "compile_cache_folder",
    "enable_compile_cache",
    "local_folder",
    "role_homes",
]
