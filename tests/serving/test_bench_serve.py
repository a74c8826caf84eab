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


@pytest.mark.slow
def test_serve_http_bench_writes_its_figures(load_bench, tmp_path, capsys):
    pytest.importorskip("openai")
    bench = load_bench("serve_http")
    out = tmp_path / "serve_http.json"
    assert bench.main(["--rates", "4,inf", "--requests", "4", "--repeat", "1", "--batch", "2",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["rate_req_per_s"] for r in result["server"]] == [4.0, "inf"]
    assert all(r["requests"] == 4 and r["tokens_per_s"] > 0 for r in result["server"])
    assert result["hf_generate"]["generated_tokens"] == result["server"][0]["generated_tokens"]
    assert result["engine_in_process"]["generated_tokens"] == result["server"][0][
        "generated_tokens"]
    assert len(result["all_at_once_runs"]) == 1 and result["speedup_over_hf"]["in_process"] > 0
    assert result["prefix_cache"]["prompt_tokens"] == 128
    assert "HF generate" in capsys.readouterr().out
