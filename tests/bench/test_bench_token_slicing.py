"""The token-slicing benchmark runs its quick rows and keeps the paper's shape: the DP is never
worse than the best uniform slicing nor than no slicing, and slices come long first."""

import json


def test_token_slicing_bench_quick_rows(load_bench, tmp_path, capsys):
    bench = load_bench("token_slicing")
    out = tmp_path / "token_slicing.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["setting"] for r in rows] == list(bench.QUICK)
    for r in rows:
        assert r["est_with_s"] <= r["est_best_uniform_s"] * (1 + 1e-12) < r["est_without_s"]
        assert sum(r["batch_slices"]) == r["replica_batch"]
        for slices in r["token_slices"]:
            assert sum(slices) == r["seq_len"] and all(s % 8 == 0 for s in slices)
            assert slices == sorted(slices, reverse=True)
    assert "paper w/o" in capsys.readouterr().out


def test_compact_folds_runs_of_three_or_more(load_bench):
    bench = load_bench("token_slicing")
    assert bench.compact((64, 64, 64, 56, 48)) == "[64]x3+[56,48]"
    assert bench.compact((704, 688, 656)) == "[704,688,656]"
