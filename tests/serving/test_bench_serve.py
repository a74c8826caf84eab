"""The serving benchmark script runs and writes its JSON (numbers are not asserted here)."""

import json

import pytest


@pytest.mark.slow
def test_serve_bench_writes_rows(load_bench, tmp_path, capsys):
    bench = load_bench("serve")
    out = tmp_path / "serve.json"
    assert bench.main(["--models", "gpt:tiny", "--batch", "2", "--requests", "4",
                       "--repeat", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["system"], r["batch"]) for r in result["rows"]] == [("naive", 2), ("engine", 2)]
    assert all(r["same_tokens"] for r in result["rows"])
    assert "tok/s" in capsys.readouterr().out


@pytest.mark.slow
def test_prefix_chunk_bench_writes_both_tables(load_bench, tmp_path, capsys):
    bench = load_bench("prefix_chunk")
    out = tmp_path / "prefix_chunk.json"
    assert bench.main(["--layers", "1", "--d-model", "64", "--context", "128", "--prefix", "64",
                       "--long", "64", "--repeat", "1", "--long-prompts", "1", "--every", "2",
                       "--budget", "16", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    cases = [(r["caching"], r["case"], r["cached_tokens"]) for r in result["prefix_cache"]["rows"]]
    assert cases == [(True, "cold", 0), (True, "warm", 64), (False, "repeated", 0)]
    assert [r["max_num_batched_tokens"] for r in result["chunked_prefill"]["rows"]] == [None, 16]
    assert result["prefix_cache"]["same_tokens"] and result["chunked_prefill"]["same_tokens"]
    assert "TTFT ms" in capsys.readouterr().out
