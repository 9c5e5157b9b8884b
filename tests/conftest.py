"""Shared test configuration.

JAX runs on the CPU in tests; the suite must pass on a 2-core machine without an accelerator.
Every process of the session compiles without XLA's CPU fusion emitters
(`run_helpers.FAST_COMPILE_XLA_FLAGS`, added to ``XLA_FLAGS``): in about half the CPU time, for
kernels that run slower, and the tests check results, never speed.
Hypothesis profiles: `hypothesis_profiles` (``TANDEM_HYPOTHESIS_PROFILE=nightly``).

One JAX compilation cache serves the whole session (`pytest_configure`): the test processes
(xdist workers) and every `tandem party`, benchmark or worker process the tests start (they
inherit ``JAX_COMPILATION_CACHE_DIR``). A kernel that many tests or processes compile (the same
small models, runs restarted after a kill) is compiled once; the executables are the ones a
fresh compile gives (the cache is keyed by the computation, the compiler and its flags), the
trace counts the retrace tests read are Python's own and unchanged, and the folder is removed
when the session ends. The hostile-network tests turn it off around their runs
(`hostile_helpers.run_pair`): their attacks run beside a short training, which must last
as long as it does with its compilations.
"""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

import hypothesis_profiles  # noqa: F401  (registers and loads the Hypothesis profile)
from run_helpers import FAST_COMPILE_XLA_FLAGS

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
if FAST_COMPILE_XLA_FLAGS and FAST_COMPILE_XLA_FLAGS not in os.environ["XLA_FLAGS"].split():
    os.environ["XLA_FLAGS"] += f" {FAST_COMPILE_XLA_FLAGS}"


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller's environment is set
        return
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        folder = tempfile.mkdtemp(prefix="tandem-tests-jax-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    # every kernel, however small or quick to compile (JAX's defaults skip those under 1 s)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    # JAX writes an entry in place, without a lock (a size cap would add one, and a scan of
    # the folder at every write): a process that reads an entry while another writes it
    # warns and compiles again, which pyproject.toml's filterwarnings lets pass


def pytest_collection_modifyitems(config, items):
    """Files holding a ``slow`` test run first, each file's tests kept together and in order.
    ``--dist load`` (the Makefile) hands tests to the workers in this order as they free up:
    the long tests start early and the session ends on short ones instead of one worker
    waiting for the other's last long test (longest-first scheduling)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: order kept otherwise


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
    run must end with. Once per session: the xdist workers share it (the first to ask runs
    it under a lock in the session's temporary folder, which all its workers share, and names
    its folder in a marker; the others load that folder's exports). The same kernels on the
    same machine give the same bits in any process: the attacked runs already compare their
    own processes' exports with it."""
    import asyncio
    import fcntl

    from hostile_helpers import EPOCHS, EVERY, assert_done, make_job, run_pair
    from party_helpers import Job

    def run() -> Job:
        job = make_job(tmp_path_factory.mktemp("hostile-reference"))
        results, _ = asyncio.run(run_pair(job))
        assert_done(results)
        return job

    if "PYTEST_XDIST_WORKER" not in os.environ:  # the parent folder outlives this session
        return run()
    shared = tmp_path_factory.getbasetemp().parent  # this session's, one per xdist run
    marker = shared / "hostile-reference.done"
    with open(shared / "hostile-reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if marker.exists():  # a worker ran it: its exports (nothing is written there again)
            return Job(Path(marker.read_text()), epochs=EPOCHS, every=EVERY)
        job = run()  # a failure leaves no marker: the next worker runs it afresh
        marker.write_text(str(job.folder))
        return job
