"""``[data] in_memory = false``: a split party's features in a file mapping
(`tandem.parties.data.mapped`). The gather gives the rows the in-memory path gives and maps
none of the file's pages, no file is left behind (exit or kill), and a party pair trains to
the same bits either way."""

from __future__ import annotations

import asyncio
import mmap
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import load_file

from table_helpers import TableJob
from tandem.engine.data import BatchRows
from tandem.parties.data import DataError, mapped, parse_data_config
from tandem.parties.data.mapped import ColumnSpill, MappedRows
from tandem.parties.data.preprocess import allocate_features

linux_only = pytest.mark.skipif(
    not os.path.exists("/proc/self/pagemap") or not hasattr(mmap, "MADV_DONTNEED"),
    reason="reads /proc/self/smaps and /proc/self/pagemap and needs madvise(MADV_DONTNEED)",
)


def _smaps_field(array: np.ndarray, field: str) -> str:
    """The value of ``field`` ("Rss", "VmFlags", ...) in the /proc/self/smaps entry of the
    mapping holding ``array``."""
    address = array.__array_interface__["data"][0]
    with open("/proc/self/smaps", encoding="ascii") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == f"{field}:":
                return line.split(":", 1)[1].strip()
    raise AssertionError("the array's mapping is not in /proc/self/smaps")


def _resident_bytes(array: np.ndarray) -> int:
    """Bytes of ``array``'s pages that are mapped in this process: the present bit of each
    page's entry in /proc/self/pagemap (what smaps sums as ``Rss``, read for these pages
    alone, so measuring after every window of a gather stays cheap)."""
    page = mmap.PAGESIZE
    address = array.__array_interface__["data"][0]
    first, last = address // page, (address + array.nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), np.uint64)
    return int(np.count_nonzero(entries >> np.uint64(63))) * page


@linux_only
def test_the_mapping_keeps_the_default_advice(tmp_path):
    # advised random ("rr"), the kernel would not credit the dropped pages' accesses, and the
    # rows read in every batch would be the first pages the page cache's reclaim evicts
    m = MappedRows.from_array(np.ones((1000, 4), np.float32), str(tmp_path))
    flags = _smaps_field(np.asarray(m), "VmFlags").split()
    assert "rd" in flags and "rr" not in flags and "sr" not in flags


def test_gather_and_views_equal_the_array(tmp_path):
    x = np.random.default_rng(0).normal(size=(1000, 7)).astype(np.float32)
    m = MappedRows.from_array(x, str(tmp_path))
    assert m.shape == (1000, 7) and len(m) == 1000 and m.dtype == np.float32
    idx = np.random.default_rng(1).permutation(1000)[:300]
    assert m.gather(idx).tobytes() == x[idx].tobytes()
    part = m.rows(100, 400)
    assert len(part) == 300 and part.gather(slice(5, 9)).tobytes() == x[105:109].tobytes()
    assert np.asarray(part).tobytes() == x[100:400].tobytes()
    # the batch gather reads a RowSource through `gather`, for runs and scattered rows alike
    rows = BatchRows(part, np.array([3, 4, 5, 9, 1]))
    assert rows[0:3].tobytes() == x[103:106].tobytes()
    assert rows[2:5].tobytes() == x[[105, 109, 101]].tobytes()
    assert len(m.rows(1000, 1000)) == 0


@linux_only
def test_the_gather_holds_at_most_a_window_of_the_file(tmp_path, monkeypatch):
    """64 MiB of rows gathered in random batches, in runs and in batches with repeated and
    negative indices: the bytes are the array's; while a gather copies, the process holds at
    most one window of the file's pages (measured before each drop: the peak), and none
    once it returns; indexing the view maps pages and keeps them."""
    rows, cols, batch = 1 << 18, 64, 2048  # 256 B rows, 64 MiB in all
    x = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    order = np.random.default_rng(2).permutation(rows)
    m = MappedRows.from_array(x, str(tmp_path))
    view = np.asarray(m)
    peaks = []
    drop = mapped._Mapping.drop

    def measured_drop(self, lo=0, hi=None):
        peaks.append(_resident_bytes(view))
        drop(self, lo, hi)

    monkeypatch.setattr(mapped._Mapping, "drop", measured_drop)
    for start in range(0, rows, batch):
        idx = order[start : start + batch]
        assert m.gather(idx).tobytes() == x[idx].tobytes()
    for start in range(0, rows, 4 * batch):
        run = slice(start, start + 4 * batch)
        assert m.gather(run).tobytes() == x[run].tobytes()
    odd = np.array([5, 5, 6, 7, -1, 0, 1, rows - 2])
    assert m.gather(odd).tobytes() == x[odd].tobytes()
    part = m.rows(1000, 3000)
    assert part.gather(np.array([0, 1, 1999])).tobytes() == x[[1000, 1001, 2999]].tobytes()
    assert m.gather(slice(10, 30, 3)).tobytes() == x[10:30:3].tobytes()
    assert m.gather(np.array([], np.int64)).shape == (0, cols)
    assert _resident_bytes(view) == 0
    assert len(peaks) > 8 * rows // batch  # a random batch spans every window of the file
    assert 0 < max(peaks) <= mapped.GATHER_WINDOW + 4 * mapped._HUGE < x.nbytes // 2
    with pytest.raises(IndexError, match="out of range"):
        m.gather(np.array([rows]))
    with pytest.raises(IndexError, match="out of range"):
        part.gather(np.array([2000]))
    assert view[:1000].sum() > 0 and _resident_bytes(view) > 0  # the view is a mapping


@linux_only
def test_the_loader_buffer_drops_each_column_and_transposes_to_rows(tmp_path):
    n, numeric, categorical = 1 << 16, 3, 2
    f = allocate_features(n, numeric, categorical, packed=True, spill_dir=str(tmp_path))
    assert f.spill is not None and f.packed is not None
    want = np.random.default_rng(3).normal(size=(n, numeric + categorical)).astype(np.float32)
    for j in range(numeric):
        f.numeric[:, j] = want[:, j]
        f.release()
        assert _resident_bytes(f.spill.matrix) == 0
    f.categorical[:] = want[:, numeric:]
    rows = f.spill.to_rows()
    assert np.asarray(rows).tobytes() == want.tobytes()
    assert _resident_bytes(f.spill.matrix) == 0


@pytest.mark.parametrize("block_rows", [1000, 1 << 14, 1 << 16])
def test_to_rows_writes_whole_2_mib_pieces_and_the_same_bytes(tmp_path, monkeypatch, block_rows):
    # 5 columns: 20-byte rows, so no block of rows ends on a 2 MiB boundary; 1000-row blocks
    # are smaller than 2 MiB, 2**16-row blocks larger: every write but the last is a whole
    # number of 2 MiB pieces from an offset that is one, so the page cache can hold 2 MiB
    # folios.
    n, columns = 300_001, 5
    spill = ColumnSpill(str(tmp_path), n, columns)
    want = np.random.default_rng(4).normal(size=(n, columns)).astype(np.float32)
    spill.matrix[:] = want
    writes: list[int] = []
    real_fdopen = mapped.os.fdopen

    class Recording:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            writes.append(len(data))
            return self.f.write(data)

    monkeypatch.setattr(mapped, "_BLOCK_ROWS", block_rows)
    monkeypatch.setattr(mapped.os, "fdopen", lambda *a, **k: Recording(real_fdopen(*a, **k)))
    rows = spill.to_rows()
    huge = 2 << 20
    assert all(w % huge == 0 for w in writes[:-1]) and sum(writes) == n * columns * 4
    assert writes[-1] == n * columns * 4 % huge
    assert np.asarray(rows).tobytes() == want.tobytes()


def test_no_file_is_left_in_the_spill_dir(tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    x = np.ones((100, 4), np.float32)
    kept = [MappedRows.from_array(x, str(spill)), ColumnSpill(str(spill), 100, 4)]
    assert os.listdir(spill) == []  # unlinked as soon as mapped
    del kept
    # a process killed while it holds its mappings leaves nothing either
    code = textwrap.dedent(
        f"""
        import sys, time, numpy as np
        from tandem.parties.data.mapped import ColumnSpill, MappedRows
        m = MappedRows.from_array(np.ones((1000, 8), np.float32), {str(spill)!r})
        c = ColumnSpill({str(spill)!r}, 1000, 8)
        print("mapped", flush=True)
        time.sleep(60)
        """
    )
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == b"mapped"
            assert os.listdir(spill) == []
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert os.listdir(spill) == []


def test_the_keys_are_checked(tmp_path):
    base = {"source": "t.csv", "id_column": "cid"}
    assert parse_data_config(base).in_memory is False
    cfg = parse_data_config({**base, "spill_dir": "cache"}, path=tmp_path / "p.toml")
    assert cfg.spill_dir == str(tmp_path / "cache")
    with pytest.raises(DataError, match="in_memory must be true or false"):
        parse_data_config({**base, "in_memory": "no"})
    with pytest.raises(DataError, match="remove one of the two"):
        parse_data_config({**base, "in_memory": True, "spill_dir": "cache"})
    with pytest.raises(DataError, match="resident_mb"):  # an unknown key is refused
        parse_data_config({**base, "resident_mb": 64})
    with pytest.raises(DataError, match="cannot create the features file"):
        ColumnSpill(str(tmp_path / "absent"), 10, 2)


def _train(folder, data_keys):
    job = TableJob(folder, ["bank", "shop"], epochs=2)
    for name in job.parties:
        job.cfg[name]["data"].update(data_keys)
        job.cfg[name].pop("checkpoint")
    results = asyncio.run(job.run_all())
    for result in results.values():
        assert not isinstance(result, BaseException), result
        assert result["status"] == "done", result
    return {
        name: load_file(str(folder / "out" / name / f"{name}.safetensors")) for name in job.parties
    }


def test_a_party_pair_trains_to_the_same_bits_in_memory_or_mapped(tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    mapped = _train(tmp_path / "mapped", {"in_memory": False, "spill_dir": str(spill)})
    assert os.listdir(spill) == []
    in_memory = _train(tmp_path / "memory", {"in_memory": True})
    for name, tensors in in_memory.items():
        assert sorted(tensors) == sorted(mapped[name]) and tensors
        for key, value in tensors.items():
            assert value.tobytes() == mapped[name][key].tobytes(), (name, key)
