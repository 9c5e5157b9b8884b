"""Shared test configuration.

JAX runs on the CPU in tests; the suite must pass on a 2-core machine without an accelerator.
Hypothesis profiles: `hypothesis_profiles` (``TANDEM_HYPOTHESIS_PROFILE=nightly``).
"""

import os

import pytest

import hypothesis_profiles  # noqa: F401  (registers and loads the Hypothesis profile)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")


@pytest.fixture
async def http_pair():
    """Factory of live HTTP transport pairs (`http_helpers.open_pair`, same arguments); every
    transport it made is closed when the test ends."""
    from http_helpers import open_pair  # here: the environment above is set before tandem loads

    made = []

    async def make(*args, **kwargs):
        pair = await open_pair(*args, **kwargs)
        made.extend(pair)
        return pair

    yield make
    for t in made:
        await t.aclose()


@pytest.fixture(scope="session")
def hostile_reference(tmp_path_factory):
    """The `hostile_helpers` job run once without any attack: the parameters every attacked
    run must end with."""
    import asyncio

    from hostile_helpers import assert_done, make_job, run_pair

    job = make_job(tmp_path_factory.mktemp("hostile-reference"))
    results, _ = asyncio.run(run_pair(job))
    assert_done(results)
    return job
