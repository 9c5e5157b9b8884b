"""`tandem.parties.cli.allocator.tune_allocator`: what it sets, what it leaves alone, what it
refuses."""

import platform
import subprocess
import sys

import pytest

from tandem.parties.cli.allocator import tune_allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _in_child(env_extra: dict[str, str]) -> str:
    """Call tune_allocator in a fresh interpreter (the setting is process-wide)."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(env_extra)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from tandem.parties.cli.allocator import tune_allocator;"
            "print(sorted(tune_allocator().items()))",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_sets_both_thresholds_and_the_heaps_on_glibc():
    assert _in_child({}) == str(
        sorted(
            {
                "MALLOC_ARENA_MAX": 2,
                "MALLOC_MMAP_THRESHOLD_": 32 << 20,
                "MALLOC_TRIM_THRESHOLD_": 128 << 20,
            }.items()
        )
    )


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_user_environment_wins():
    got = _in_child({"MALLOC_TRIM_THRESHOLD_": "1000000", "MALLOC_ARENA_MAX": "4"})
    assert got == str([("MALLOC_MMAP_THRESHOLD_", 32 << 20)])


@pytest.mark.parametrize(
    "kw",
    [
        {"mmap_threshold": 64 << 20},
        {"mmap_threshold": -1},
        {"trim_threshold": -5},
        {"trim_threshold": 1 << 31},
        {"arena_max": 0},
    ],
)
def test_refuses_values_glibc_would_refuse(kw):
    with pytest.raises(ValueError, match="(threshold|arena_max) must be"):
        tune_allocator(**kw)


def test_cli_entry_point_tunes_before_its_loop(monkeypatch):
    import tandem.parties.cli.commands as cli

    calls = []
    monkeypatch.setattr(cli, "tune_allocator", lambda: calls.append(1) or {})

    async def main() -> int:
        assert calls == [1]
        return 7

    assert cli.run_async(main) == 7
