"""Optional dependency groups (*extras*) and the one way library code imports from them.

A plain ``pip install tandem`` gives the engine, the transports and every party. What only some
commands need comes as an extra, declared in ``pyproject.toml`` under
``[project.optional-dependencies]`` with exactly the distributions listed in `EXTRAS`
(tests/test_extras.py checks that the two agree):

* ``demo``: scikit-learn, the bundled data sets of ``tandem demo`` and ``tandem fl demo``;
* ``plot``: matplotlib, the Gantt picture (``tandem demo --trace``) and ``tandem elastic demo
  --plot``;
* ``psi``: cryptography and gmpy2, the private set intersection of ``tandem align``;
* ``keys``: cryptography, per-party Ed25519 signing keys (``[security] private_key``,
  ``tandem keys generate``);
* ``parquet``: pyarrow, the reader of ``.csv`` and ``.parquet`` data files (`tandem.parties.data`);
* ``flax``, ``equinox``: the model adapters of those libraries (`tandem.parties.models`);
* ``tensorboard``: tensorboardX, the event files of ``[log] tensorboard`` (`tandem party`);
* ``privacy``: dp-accounting, the (epsilon, delta) accountant of the differential-privacy
  defenses;
* ``ray``: ray, elastic training and federated simulation placed on a Ray cluster.

Code that needs an extra imports it lazily, inside the block of `needs` (or checks it early with
`require`), so a missing extra becomes a `tandem.errors.MissingExtraError` (a ``ConfigError``:
the CLI prints it and exits 2) that names the feature, the missing module and the install
command, never a bare ``ModuleNotFoundError`` from deep inside a run.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping

from tandem.errors import MissingExtraError

#: extra name -> the (distribution, top-level module) pairs it installs.
EXTRAS: Mapping[str, tuple[tuple[str, str], ...]] = {
    "demo": (("scikit-learn", "sklearn"),),
    "plot": (("matplotlib", "matplotlib"),),
    "psi": (("cryptography", "cryptography"), ("gmpy2", "gmpy2")),
    "keys": (("cryptography", "cryptography"),),
    "parquet": (("pyarrow", "pyarrow"),),
    "flax": (("flax", "flax"),),
    "equinox": (("equinox", "equinox"),),
    "tensorboard": (("tensorboardx", "tensorboardX"),),  # normalised name (PEP 503)
    "privacy": (("dp-accounting", "dp_accounting"),),
    "ray": (("ray", "ray"),),
}


@contextlib.contextmanager
def needs(extra: str, purpose: str) -> Iterator[None]:
    """Run the block, whose imports come from ``extra``; an ``ImportError`` inside it becomes
    a `MissingExtraError` saying that ``purpose`` needs the extra and how to install it.

    Usage::

        with needs("plot", "the Gantt picture"):
            from matplotlib.figure import Figure
    """
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; the extras are {sorted(EXTRAS)}")
    try:
        yield
    except ImportError as exc:
        dists = " and ".join(dist for dist, _ in EXTRAS[extra])
        missing = f"module {exc.name!r}" if exc.name else "a module"
        raise MissingExtraError(
            f"{purpose} needs {dists} (the {extra!r} extra), but {missing} cannot be imported "
            f"({exc}); install it with: pip install 'tandem[{extra}]'",
            extra=extra,
        ) from exc


def require(extra: str, purpose: str) -> None:
    """Check, before any work starts, that every module of ``extra`` imports; raise
    `MissingExtraError` (as `needs` does) if one does not."""
    with needs(extra, purpose):
        for _, module in EXTRAS[extra]:
            importlib.import_module(module)
