"""``[checkpoint] compile_cache``: a party process keeps its compiled kernels in JAX's
persistent compilation cache, so a second process on the same folder compiles nothing."""

from __future__ import annotations

import os

import pytest

from party_helpers import Job
from tandem.parties.compile_cache import FOLDER, cache_folder, compile_cache_folder, role_homes
from tandem.parties.split.process.config import PartyConfigError


def test_the_folder_follows_the_setting():
    env: dict[str, str] = {}
    assert compile_cache_folder(True, "/c", "/e", env) == os.path.join("/c", FOLDER)
    assert compile_cache_folder(True, None, "/e", env) == os.path.join("/e", FOLDER)
    assert compile_cache_folder(True, None, None, env) is None
    assert compile_cache_folder(False, "/c", "/e", env) is None
    assert compile_cache_folder("/x", "/c", "/e", env) == "/x"
    # the environment's folder wins over the default, not over a folder the file names
    env = {"JAX_COMPILATION_CACHE_DIR": "/env"}
    assert compile_cache_folder(True, "/c", "/e", env) == "/env"
    assert compile_cache_folder("/x", "/c", "/e", env) == "/x"
    assert compile_cache_folder(False, "/c", "/e", env) is None


def test_an_empty_folder_is_refused_naming_the_key(tmp_path):
    from tandem.parties.split.process.build import load_party_config

    job = Job(tmp_path)
    job.cfg["leader"]["checkpoint"]["compile_cache"] = ""
    job.write()
    with pytest.raises(PartyConfigError, match="compile_cache"):
        load_party_config(job.path("leader"))


def cache_entries(folder) -> set[str]:
    return {n for n in os.listdir(folder) if not n.endswith("-atime")}


@pytest.mark.slow
def test_a_second_process_on_the_same_folder_compiles_nothing(tmp_path):
    """The first run fills each party's cache (default folder: beside its checkpoints); a
    fresh start of both parties (new processes, the same kernels) adds no entry: every
    compilation was found in the cache."""
    job = Job(tmp_path, epochs=1)
    for role in ("leader", "follower"):
        job.cfg[role]["checkpoint"]["compile_cache"] = True
    # the folder of the test session (tests/conftest.py) would win over the default one
    saved = os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    try:
        first = job.run_both()
        folders = {r: tmp_path / "ckpt" / r / FOLDER for r in ("leader", "follower")}
        before = {r: cache_entries(f) for r, f in folders.items()}
        job.args = {"leader": ["--fresh"], "follower": ["--fresh"]}
        second = job.run_both(tag="-again")
    finally:
        if saved is not None:
            os.environ["JAX_COMPILATION_CACHE_DIR"] = saved
    for run in (first, second):
        for rc, out, err in run.values():
            assert rc == 0 and out["status"] == "done", err[-3000:]
    for role, folder in folders.items():
        assert len(before[role]) >= 4, f"{role} cached {sorted(before[role])}"
        assert cache_entries(folder) == before[role], f"{role} compiled again"


def test_the_homes_of_the_fl_and_elastic_roles():
    """Checkpoint's folder, then the export's, then the TOML's; URLs are not local folders."""
    env: dict[str, str] = {}
    homes = role_homes(
        "/s/state/server.ckpt", "/s/out/m.st", "/s/server.toml", checkpoint_is_file=True
    )
    assert cache_folder(True, homes, env) == os.path.join("/s/state", FOLDER)
    homes = role_homes("s3://b/ckpt", None, "/s/ds.toml", checkpoint_is_file=False)
    assert cache_folder(True, homes, env) == os.path.join("/s", FOLDER)
    homes = role_homes("file:///d/ckpts", None, "/s/ds.toml", checkpoint_is_file=False)
    assert cache_folder(True, homes, env) == os.path.join("/d/ckpts", FOLDER)
    assert cache_folder(False, homes, env) is None
    assert cache_folder("/x", homes, env) == "/x"
    assert cache_folder(True, homes, {"JAX_COMPILATION_CACHE_DIR": "/env"}) == "/env"


def test_elastic_files_take_the_key_and_refuse_an_empty_folder(tmp_path):
    from tandem.parties.elastic.config import WorkerFile, load_role
    from tandem.parties.elastic.errors import ConfigError as ElasticConfigError

    worker = tmp_path / "worker.toml"
    worker.write_text('name = "w"\ncoordinator = "http://127.0.0.1:1"\ncompile_cache = "c"\n')
    assert load_role(WorkerFile, str(worker)).compile_cache == "c"
    worker.write_text('name = "w"\ncoordinator = "http://127.0.0.1:1"\ncompile_cache = ""\n')
    with pytest.raises(ElasticConfigError, match="compile_cache"):
        load_role(WorkerFile, str(worker))
