"""`bench.ctr`: the click-through workload split by columns, for one and three followers."""

import json

import pytest

from run_helpers import run_bench

pq = pytest.importorskip("pyarrow.parquet")


@pytest.mark.parametrize("followers", [1, 3])
def test_columns_split_between_parties_and_ids_line_them_up(tmp_path, followers):
    printed, _ = run_bench(
        "ctr", "--rows", "3000", "--followers", str(followers), "--row-group", "1000",
        "--vocab", "10", "300", "--out", str(tmp_path),
    )  # fmt: skip
    manifest = json.loads((tmp_path / "workload.json").read_text())
    assert printed == {k: v for k, v in manifest.items() if k != "workload"}
    parties = (
        ["leader", "follower"]
        if followers == 1
        else ["leader", "follower1", "follower2", "follower3"]
    )
    assert list(manifest["parties"]) == parties
    vocab = manifest["workload"]["vocab"]
    assert vocab[0] == 10 and vocab[-1] == 300
    tables = {p: pq.read_table(tmp_path / f"{p}.parquet") for p in parties}
    files = {p: pq.ParquetFile(tmp_path / f"{p}.parquet") for p in parties}
    assert all(f.metadata.num_row_groups == 3 for f in files.values())
    # the leader holds the label, 13 dense and 13 categorical columns; the followers the rest
    leader = manifest["parties"]["leader"]
    assert "label" in tables["leader"].column_names
    assert len(leader["dense"]) == 13 and len(leader["categorical"]) == 13
    followers_cols = [manifest["parties"][p] for p in parties[1:]]
    dense = [c for f in followers_cols for c in f["dense"]]
    cats = [c for f in followers_cols for c in f["categorical"]]
    assert len(dense) == len(set(dense)) == 13 and len(cats) == len(set(cats)) == 13
    assert not set(dense + cats) & set(leader["dense"] + leader["categorical"])
    assert all("label" not in tables[p].column_names for p in parties[1:])
    # the same ids, each party in its own order
    ids = {p: tables[p]["id"].to_pylist() for p in parties}
    assert all(sorted(v) == sorted(ids["leader"]) for v in ids.values())
    assert all(ids[p] != ids["leader"] for p in parties[1:])
    # the label depends on every party: all columns predict it better than the leader's
    assert manifest["bayes_auc"] > manifest["bayes_auc_leader_term"] + 0.03
    # each party declares its columns' catalogs: V_j distinct values holding every table value
    for p in parties:
        declared = json.loads((tmp_path / manifest["parties"][p]["vocabularies"]).read_text())
        assert list(declared) == manifest["parties"][p]["categorical"]
        for name, values in declared.items():
            j = int(name[1:]) - 1
            assert len(values) == len(set(values)) == vocab[j]
            assert set(tables[p][name].to_pylist()) <= set(values)
