"""`tandem.parties.cli.affinity.colocate_python_threads`: which threads it pins, what it leaves
alone (XLA's worker pools, a process limited to one CPU, ``TANDEM_PYTHON_CPU=off``), what it
refuses, and that the pipeline commands of ``tandem`` (only those) call it before their event
loop."""

import json
import os
import subprocess
import sys

import pytest

from tandem.errors import ConfigError
from tandem.parties.cli.affinity import ENV, colocate_python_threads, thread_cpus

LINUX = sys.platform.startswith("linux") and hasattr(os, "sched_setaffinity")
MULTI = LINUX and len(os.sched_getaffinity(0)) >= 2
needs_two_cpus = pytest.mark.skipif(not MULTI, reason="needs Linux and at least two CPUs")

# Runs in a fresh interpreter (affinity is per thread and inherited): pins, starts a thread,
# then reports every thread's CPU list by name.
_CHILD = r"""
import json, os, sys, threading
from tandem.parties.cli.affinity import colocate_python_threads
cpu = colocate_python_threads(None if len(sys.argv) < 2 else sys.argv[1])
started = {}
def lane():
    started["cpus"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=lane); t.start(); t.join()
threads = []
for tid in os.listdir("/proc/self/task"):
    try:  # a short-lived thread may exit between the listing and the read
        name = open(f"/proc/self/task/{tid}/comm").read().strip()
        cpus = [l.split(":")[1].strip() for l in open(f"/proc/self/task/{tid}/status")
                if l.startswith("Cpus_allowed_list")][0]
    except (FileNotFoundError, ProcessLookupError):
        continue
    threads.append([name, cpus])
print(json.dumps({"cpu": cpu, "main": sorted(os.sched_getaffinity(0)),
                  "started": started["cpus"], "threads": threads}))
"""


def _child(*args: str, env: dict[str, str] | None = None, taskset: str | None = None) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k != ENV}
    full_env.update(env or {})
    cmd = [sys.executable, "-c", _CHILD, *args]
    if taskset is not None:
        cmd = ["taskset", "-c", taskset, *cmd]
    out = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_two_cpus
def test_pins_the_calling_thread_and_the_threads_it_starts_not_xla_pools():
    allowed = sorted(os.sched_getaffinity(0))
    got = _child()
    assert got["cpu"] in allowed
    assert got["main"] == [got["cpu"]] and got["started"] == [got["cpu"]]
    # XLA's intra-op pool was started before the pin: it keeps every CPU, kernels stay parallel
    xla = [cpus for name, cpus in got["threads"] if name.startswith("tf_XLA")]
    assert xla, got["threads"]
    assert all(c != str(got["cpu"]) for c in xla), got["threads"]


@needs_two_cpus
def test_a_named_cpu_is_used_and_off_changes_nothing():
    allowed = sorted(os.sched_getaffinity(0))
    got = _child(str(allowed[-1]))
    assert got["cpu"] == allowed[-1] and got["main"] == [allowed[-1]]
    got = _child(env={ENV: str(allowed[0])})
    assert got["cpu"] == allowed[0] and got["started"] == [allowed[0]]
    got = _child(env={ENV: "off"})
    assert got["cpu"] is None and got["main"] == allowed and got["started"] == allowed


@needs_two_cpus
def test_a_process_allowed_one_cpu_is_left_alone():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    got = _child(taskset=str(cpu))
    assert got["cpu"] is None and got["main"] == [cpu]


@pytest.mark.skipif(not LINUX, reason="CPU affinity is Linux's")
@pytest.mark.parametrize(
    "value, match",
    [("9999", "names a CPU this process may not use"), ("fast", "is not understood")],
)
def test_refuses_a_cpu_it_cannot_use_and_says_which_it_can(value, match):
    before = thread_cpus()
    with pytest.raises(ConfigError, match=match) as info:
        colocate_python_threads(environ={ENV: value})
    assert str(sorted(before)) in str(info.value)
    assert thread_cpus() == before  # nothing changed


@pytest.mark.parametrize(
    "argv, pins",
    [
        (["demo"], True),
        (["party", "--config", "x.toml"], True),
        (["predict", "--config", "x.toml"], True),
        (
            [
                "align",
                "--name",
                "a",
                "--role",
                "leader",
                "--peer",
                "b=http://h:1",
                "--ids",
                "i.csv",
                "--out",
                "o.csv",
            ],
            False,
        ),  # its ECDH process pool must keep every CPU
        (["fl", "demo"], False),
        (["elastic", "demo"], False),
    ],
)
def test_only_pipeline_commands_ask_for_the_pin(argv, pins):
    from tandem.parties.cli import build_parser

    args = build_parser().parse_args(argv)
    assert getattr(args, "colocate_threads", False) is pins


def test_cli_pins_before_its_loop_and_reports_a_bad_setting(monkeypatch, capsys):
    import tandem.parties.cli as cli
    import tandem.parties.cli.affinity as affinity

    calls = []
    monkeypatch.setattr(affinity, "colocate_python_threads", lambda: calls.append("pin"))

    async def main() -> int:
        assert calls == ["pin"]
        return 3

    assert cli.run_async(main, colocate_threads=True) == 3
    calls.clear()

    async def main_without_pin() -> int:
        return 4

    assert cli.run_async(main_without_pin) == 4 and calls == []

    def refuse():
        raise ConfigError(f"{ENV}=fast is not understood")

    monkeypatch.setattr(affinity, "colocate_python_threads", refuse)
    assert cli.main(["demo", "--quiet"]) == 2
    assert "TANDEM_PYTHON_CPU=fast is not understood" in capsys.readouterr().err
