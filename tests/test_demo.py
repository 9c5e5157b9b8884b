import asyncio
import json

import pytest

from tandem.parties.split.process.demo import run_demo


@pytest.mark.slow
def test_demo_reaches_accuracy_and_writes_trace_and_gantt(tmp_path):
    result = asyncio.run(
        run_demo(epochs=8, trace_dir=str(tmp_path), progress=False, timing_batches=2, chunks=2)
    )
    assert result["test_accuracy"] >= 0.95
    assert 1 <= result["n_groups"] <= 64
    assert result["sequential_s"] > 0 and result["pipelined_s"] > 0
    trace = json.loads((tmp_path / "trace_pipelined.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert any(n.startswith("F(") for n in names) and any(n.startswith("S(") for n in names)
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"compute", "send->leader", "send->follower"} <= lanes
    assert (tmp_path / "gantt.png").stat().st_size > 10_000
    # the timed pipelined batches sent each group's activation in (up to) 2 parts
    from tandem.engine.microbatch import fit_chunks

    n = result["n_groups"]
    sends = [
        e
        for e in trace["traceEvents"]
        if e["ph"] == "X" and e["name"].startswith("S(act/bottom_follower->top,")
    ]
    assert len(sends) == 2 * n * fit_chunks(64, n, 2)


def test_cli_parser_lists_demo():
    from tandem.parties.cli import build_parser

    args = build_parser().parse_args(["demo", "--epochs", "1", "--groups", "3", "--chunks", "2"])
    assert args.epochs == 1 and args.groups == "3" and args.chunks == 2
