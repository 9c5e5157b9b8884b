"""`tandem fl demo` end to end: progress on stderr, one JSON line on stdout."""

from __future__ import annotations

import orjson

from tandem.parties.cli import main


def test_fl_demo_prints_a_json_line(capsys):
    rc = main(
        [
            "fl",
            "demo",
            "--clients",
            "4",
            "--rounds",
            "2",
            "--hidden",
            "16",
            "--epochs",
            "1",
            "--quiet",
            "--lossless",
            "--downlink",
            "anchor",
            "--anchor-every",
            "1",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = orjson.loads(out[-1])
    assert result["mode"] == "randk" and result["rounds"] == 2
    assert 0 <= result["accuracy"] <= 100
    assert result["bytes_up"] > 0 and result["bytes_down"] > 0
