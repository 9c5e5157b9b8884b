"""`tandem align` end to end: two parties in one loop, HTTP on loopback, CSV in and out."""

import argparse
import asyncio
import contextlib
import csv
import json

import pytest

from ports import free_port
from tandem.parties.alignment import cli, ecdh
from tandem.parties.alignment.errors import AlignmentError


def parse(argv):
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))[1:]


async def test_align_command_writes_matching_rows(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_SECRET", "cli-secret")
    write_csv(tmp_path / "a.csv", ["x", "cid"], [[i, f"c{i}"] for i in range(30)])
    write_csv(tmp_path / "b.csv", ["cid"], [[f"c{i}"] for i in range(50, 10, -1)] + [["c12"]])
    pa, pb = free_port(), free_port()
    args_a = parse(
        [
            "align",
            "--name",
            "A",
            "--role",
            "leader",
            "--port",
            str(pa),
            "--peer",
            f"B=http://127.0.0.1:{pb}",
            "--ids",
            str(tmp_path / "a.csv"),
            "--column",
            "cid",
            "--out",
            str(tmp_path / "a_out.csv"),
        ]
    )
    args_b = parse(
        [
            "align",
            "--name",
            "B",
            "--role",
            "follower",
            "--port",
            str(pb),
            "--peer",
            f"A=http://127.0.0.1:{pa}",
            "--ids",
            str(tmp_path / "b.csv"),
            "--out",
            str(tmp_path / "b_out.csv"),
        ]
    )
    async with asyncio.TaskGroup() as tg:
        ra = tg.create_task(args_a.func(args_a))
        rb = tg.create_task(args_b.func(args_b))
    assert ra.result() == rb.result() == 0
    summaries = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {s["intersection_size"] for s in summaries} == {19}
    assert summaries[0]["intersection_commitment"] == summaries[1]["intersection_commitment"]
    out_a = read_csv(tmp_path / "a_out.csv")
    out_b = read_csv(tmp_path / "b_out.csv")
    assert (
        [r[1] for r in out_a]
        == [r[1] for r in out_b]
        == sorted((f"c{i}" for i in range(11, 30)), key=ecdh.canonical)
    )
    assert all(out_a_row[1] == f"c{out_a_row[0]}" for out_a_row in out_a)  # rows of a.csv


async def test_align_command_reports_bad_input(tmp_path, capsys):
    write_csv(tmp_path / "a.csv", ["cid"], [["c1"]])
    args = parse(
        [
            "align",
            "--name",
            "A",
            "--role",
            "leader",
            "--peer",
            "B=http://127.0.0.1:9",
            "--ids",
            str(tmp_path / "a.csv"),
            "--column",
            "nope",
            "--out",
            "x.csv",
        ]
    )
    assert await args.func(args) == 2  # a bad ids file, like a bad flag, stops before connecting
    assert "has no column 'nope'" in capsys.readouterr().err
    args = parse(
        [
            "align",
            "--name",
            "A",
            "--role",
            "leader",
            "--peer",
            "B",
            "--ids",
            str(tmp_path / "a.csv"),
            "--out",
            "x.csv",
        ]
    )
    assert await args.func(args) == 2
    assert "--peer must be NAME=URL" in capsys.readouterr().err


async def test_align_command_times_out_without_peer(tmp_path, capsys):
    write_csv(tmp_path / "a.csv", ["cid"], [["c1"]])
    pb = free_port()  # nobody listens there
    args = parse(
        [
            "align",
            "--name",
            "A",
            "--role",
            "leader",
            "--peer",
            f"B=http://127.0.0.1:{pb}",
            "--ids",
            str(tmp_path / "a.csv"),
            "--out",
            str(tmp_path / "o.csv"),
            "--timeout",
            "0.3",
        ]
    )
    assert await args.func(args) == 1
    assert "no result from B after 0.3 s" in capsys.readouterr().err


def test_read_ids_reads_a_csv_as_tandem_party_does(tmp_path):
    path = tmp_path / "ids.csv"
    # A byte-order mark (Excel's "CSV UTF-8"), CRLF, a quoted header, blank lines at the end.
    path.write_bytes(b'\xef\xbb\xbf"cid",x\r\n007,1\r\n 12,2\r\n\r\n')
    assert cli.read_ids(str(path), "cid") == ["007", " 12"]
    path.write_bytes(b"cid,x\n1,2\n\n3,4\n")  # a blank line is no row, as for the party
    assert cli.read_ids(str(path), "cid") == ["1", "3"]
    path.write_bytes(b"cid,x\n1,2\nNA,3\n")  # a missing id, which the party refuses
    with pytest.raises(AlignmentError, match="'cid' has no value at row 1"):
        cli.read_ids(str(path), "cid")
    path.write_bytes(b"cid,name\n1,caf\xe9\n")  # Latin-1, not UTF-8
    with pytest.raises(AlignmentError, match="not UTF-8"):
        cli.read_ids(str(path), "cid")
    path.write_bytes(b"cid\n" + b"x" * 200_000 + b"\n")  # beyond the csv module's field limit
    with pytest.raises(AlignmentError, match="not a well-formed CSV"):
        cli.read_ids(str(path), "cid")


def test_read_ids_takes_a_parquet_column_as_text(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"n": [7, 8, 9], "cid": ["007", "c2", "c3"]}), path)
    assert cli.read_ids(str(path), "cid") == ["007", "c2", "c3"]
    assert cli.read_ids(str(path), None) == ["7", "8", "9"]  # the first column, as text
    with pytest.raises(AlignmentError, match="has no column\\(s\\) \\['nope'\\]"):
        cli.read_ids(str(path), "nope")
    pq.write_table(pa.table({"cid": ["a", None]}), path)
    with pytest.raises(AlignmentError, match="'cid' has no value at row 1"):
        cli.read_ids(str(path), "cid")


async def test_an_open_host_without_a_secret_is_refused_unless_insecure(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("TANDEM_SECRET", raising=False)
    write_csv(tmp_path / "a.csv", ["cid"], [["c1"]])
    argv = ["align", "--name", "A", "--role", "leader", "--host", "0.0.0.0"]
    argv += ["--peer", "B=http://127.0.0.1:1", "--ids", str(tmp_path / "a.csv")]
    argv += ["--out", str(tmp_path / "out.csv"), "--wait", "0.2", "--timeout", "0.5"]
    assert await cli.run(parse(argv)) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0 is reachable from other machines" in err and "--insecure" in err
    # with --insecure it serves (and then gives up on the absent peer, whichever way)
    with contextlib.suppress(Exception):
        await cli.run(parse([*argv, "--insecure"]))
    err = capsys.readouterr().err
    assert "serving on http://0.0.0.0" in err and "reachable from other machines" not in err


async def test_a_failed_exchange_exits_1_with_one_line_not_a_traceback(tmp_path, capsys):
    """The leader runs a PSI per follower in a task group: a peer that stays unreachable
    (like any failure inside the exchange) is reported as one line, exit code 1."""
    write_csv(tmp_path / "a.csv", ["cid"], [["c1"]])
    argv = [
        "align",
        "--name",
        "A",
        "--role",
        "leader",
        "--peer",
        f"B=http://127.0.0.1:{free_port()}",
    ]
    argv += ["--ids", str(tmp_path / "a.csv"), "--out", str(tmp_path / "o.csv"), "--wait", "0.2"]
    assert await cli.run(parse(argv)) == 1
    err = capsys.readouterr().err
    assert "tandem align: peer 'B' at http://127.0.0.1:" in err and "unreachable" in err
    assert not (tmp_path / "o.csv").exists()
