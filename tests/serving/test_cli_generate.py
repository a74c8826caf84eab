"""`graphpar generate`: prompts file in, JSON lines out, bad requests reported, others served."""

import json

import pytest

from graphpar.cli import main as graphpar_main
from graphpar.ir.parser import load


def main(argv):
    """`graphpar generate ARGV...`"""
    return graphpar_main(["generate", *argv])


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("# one request per line\n"
                    "Hello, world\n"
                    "[1, 2, 3, 4]\n"
                    '{"prompt": "The fox", "max_tokens": 3, "temperature": 0.8, "seed": 1}\n'
                    '{"prompt": [5, 6, 7], "beam_width": 2, "n": 2, "max_tokens": 4}\n'
                    + "x" * 40 + "\n")
    return path


def test_generate_serves_and_reports_bad_requests(prompts_file, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    status = main(["--example", "gpt:tiny", "--prompts", str(prompts_file), "--max-tokens",
                   "5", "--out", str(out), "--max-num-seqs", "2"])
    assert status == 1  # one request failed; the others were served
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in records] == [2, 3, 4, 5, 6]
    assert len(records[0]["outputs"][0]["token_ids"]) == 5
    assert records[1]["prompt_tokens"] == 4
    assert len(records[2]["outputs"][0]["token_ids"]) == 3
    assert len(records[3]["outputs"]) == 2
    assert "too long for the model's context of 32" in records[4]["error"]
    err = capsys.readouterr().err
    assert "graphpar: error: request on" in err and ":6:" in err
    assert "4/5 requests served" in err and "tokens/s" in err
    assert "requests |" in err  # progress lines while it runs
    assert "Traceback" not in err


def test_generate_usage_errors(tmp_path, capsys):
    assert main(["--example", "gpt:tiny", "--prompts", str(tmp_path / "none.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_text('{"prompt": [1, 2], "colour": 3}\n')
    assert main(["--example", "gpt:tiny", "--prompts", str(bad)]) == 2
    assert "unknown: colour" in capsys.readouterr().err
    assert main(["--prompts", str(bad)]) == 2
    assert "needs a model file or --example" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_on_two_tensor_parallel_ranks(prompts_file, tmp_path, capsys):
    """The same greedy tokens as one rank, served by two (gloo) ranks."""
    outs = []
    for tp in ("1", "2"):
        out = tmp_path / f"tp{tp}.jsonl"
        assert main(["--example", "gpt:tiny", "--prompts", str(prompts_file), "--max-tokens",
                     "5", "--out", str(out), "--tp", tp, "--tp-plan", "megatron",
                     "--dump-programs", str(tmp_path / f"programs{tp}")]) == 1
        outs.append([json.loads(line) for line in out.read_text().splitlines()])
    assert sorted(p.name for p in (tmp_path / "programs1").iterdir()) == [
        "decode.gpir", "prefill.gpir"]
    # each rank's decode program: its 2 of 4 heads, its kv heads of the cache, the collectives
    (device,) = load(str(tmp_path / "programs2" / "decode.spmd.gpir"))
    attention = [n for n in device.nodes if n.op == "paged_attention"]
    assert len(attention) == 2 and attention[0].inputs[0].type.shape[1] == 2
    assert device.input("key_cache.0").type.shape[2] == 2
    assert sum(n.op in ("reduce_scatter", "all_gather") for n in device.nodes) == 10
    greedy = [0, 1]  # lines 2 and 3: greedy requests
    assert [outs[1][i]["outputs"] for i in greedy] == [outs[0][i]["outputs"] for i in greedy]
    err = capsys.readouterr().err
    assert "on 2 tensor-parallel cpu ranks (megatron plan)" in err
    # Megatron: 2 layers x 2 row-parallel sums (a reduce-scatter and an all-gather each), and 2
    # all-gathers around the vocabulary-parallel LM head
    assert "megatron plan on 2 ranks: 10 collectives per decode step" in err
    assert "2 of 4 kv heads of every block" in err
    assert main(["--example", "gpt:tiny", "--prompts", str(prompts_file), "--tp", "0"]) == 2
    assert "--tensor-parallel must be at least 1" in capsys.readouterr().err


def test_system_prompt_is_a_shared_prefix(tmp_path, capsys):
    """--system-prompt gives the tokens of writing it before every prompt."""
    plain, shared = tmp_path / "plain.txt", tmp_path / "shared.txt"
    plain.write_text("Be brief. Hello\nBe brief. abc\n")
    shared.write_text("Hello\nabc\n")
    outs = []
    for prompts, extra in ((plain, []), (shared, ["--system-prompt", "Be brief. "])):
        out = tmp_path / f"{prompts.stem}.jsonl"
        assert main(["--example", "gpt:tiny", "--prompts", str(prompts), "--max-tokens", "4",
                     "--out", str(out), "--quiet", *extra]) == 0
        outs.append([json.loads(line)["outputs"] for line in out.read_text().splitlines()])
    assert outs[0] == outs[1]


def test_prefix_caching_and_chunked_prefill_options_keep_the_tokens(tmp_path):
    """The same greedy tokens with prefix caching off, and with prompts prefilled 4 tokens a
    step; a prompt repeating an earlier one's first 16 bytes finds them cached."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox jumps\nThe quick brown fox sleeps\n")
    outs = []
    for extra in ([], ["--no-prefix-caching"], ["--max-num-batched-tokens", "4"]):
        out = tmp_path / "out.jsonl"
        assert main(["--example", "gpt:tiny", "--prompts", str(prompts), "--max-tokens", "4",
                     "--out", str(out), "--quiet", "--max-num-seqs", "1", "--block-size", "8",
                     *extra]) == 0
        records = [json.loads(line) for line in out.read_text().splitlines()]
        outs.append([r["outputs"] for r in records])
        cached = [0, 0] if extra == ["--no-prefix-caching"] else [0, 16]
        assert [r["cached_tokens"] for r in records] == cached
    assert outs[0] == outs[1] == outs[2]


def test_a_system_prompt_that_does_not_fit_is_a_usage_error(prompts_file, capsys):
    assert main(["--example", "gpt:tiny", "--prompts", str(prompts_file), "--quiet",
                 "--system-prompt", "x" * 40]) == 2
    assert "--system-prompt: prompt of 40 tokens is too long" in capsys.readouterr().err


def test_a_text_stop_string_ends_the_output_before_it(tmp_path):
    """A JSON line with a text stop: served (not a usage error), the text ends before the stop
    string, the token ids go through the tokens that completed it."""
    free, stopped = tmp_path / "free.jsonl", tmp_path / "stopped.jsonl"
    first = tmp_path / "first.txt"
    first.write_text('{"prompt": "Hello", "max_tokens": 8}\n')
    assert main(["--example", "gpt:tiny", "--prompts", str(first), "--max-tokens", "8",
                 "--out", str(free), "--quiet"]) == 0
    (record,) = [json.loads(line) for line in free.read_text().splitlines()]
    ids = record["outputs"][0]["token_ids"]
    stop_ids = [t for t in ids[2:4]]
    stop = bytes(stop_ids).decode("utf-8", errors="replace")
    second = tmp_path / "second.txt"
    second.write_text(json.dumps({"prompt": "Hello", "max_tokens": 8, "stop": [stop]}) + "\n")
    assert main(["--example", "gpt:tiny", "--prompts", str(second), "--out", str(stopped),
                 "--quiet"]) == 0
    (out,) = json.loads(stopped.read_text())["outputs"]
    text = bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")
    assert out["finish_reason"] == "stop" and stop not in out["text"]
    assert out["text"] == text[:text.index(stop)]
    assert out["token_ids"] == ids[:len(out["token_ids"])] and len(out["token_ids"]) <= 4
