"""Hypothesis profiles for the suite, chosen by ``TANDEM_HYPOTHESIS_PROFILE``:

* ``default`` (CI and local runs): derandomized, so a run is reproducible and cannot flake on
  a lucky draw; no example database; each test's own ``max_examples``.
* ``nightly``: a fresh random seed every run and ten times each test's examples, to find what
  the fixed draw does not. ``TANDEM_HYPOTHESIS_PROFILE=nightly make test``.

Tests size their search with ``@settings(max_examples=examples(N))`` so the profile scales it.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILES = {"default": 1, "nightly": 10}

settings.register_profile("default", derandomize=True, database=None, deadline=None)
settings.register_profile(
    "nightly",
    derandomize=False,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

PROFILE = os.environ.get("TANDEM_HYPOTHESIS_PROFILE", "default")
if PROFILE not in PROFILES:
    raise RuntimeError(
        f"TANDEM_HYPOTHESIS_PROFILE={PROFILE!r} is not a profile; use one of {sorted(PROFILES)}"
    )
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """``n`` examples under the default profile, ``10 n`` under ``nightly``."""
    return n * PROFILES[PROFILE]
