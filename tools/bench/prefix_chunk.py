"""Prefix caching and chunked prefill through the engine (``LLM``), on the CPU.

Two measurements, one model (a GPT, ``--layers`` x ``--d-model``, context ``--context``):

* **prefix cache**: time to first token (TTFT) of a request whose long prompt prefix
  (``--prefix`` tokens, then 8 tokens of its own) was seen before (*warm*: its KV blocks are in
  the cache) against one whose prefix is new (*cold*), with prefix caching on; and the same
  repeated prefix with caching off. One request at a time, ``max_tokens=1``; the median of
  ``--repeat`` requests each.
* **chunked prefill**: ``--streams`` short requests decode 64 tokens each while long prompts
  (``--long`` tokens, one every ``--every`` steps) arrive. Inter-token latency of the short
  streams (the time between two consecutive tokens of a stream, measured by polling the engine
  after every step) at p50 and p99, without chunking and with ``max_num_batched_tokens``
  = ``--budget``; plus the long prompts' TTFT. Each setting runs the scenario once to warm up
  (new step shapes are specialized on first use), then once measured.

Greedy tokens must be equal with and without caching and chunking; the table says so.

    python tools/bench/prefix_chunk.py                     # writes prefix_chunk.json here
    python tools/bench/prefix_chunk.py --prefix 256 --long 384 --out /tmp/p.json

Every time is measured (wall clock, ``time.perf_counter``), in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from graphpar.models import get_model
from graphpar.serving.llm import LLM, SamplingParams


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def random_tokens(n: int, vocab: int, generator: torch.Generator) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=generator).tolist()


def prefix_cache(module, vocab: int, args) -> tuple[list[dict], bool]:
    """TTFT cold vs warm with caching on, and the warm prompts again with caching off."""
    generator = torch.Generator().manual_seed(args.seed)
    shared = random_tokens(args.prefix, vocab, generator)
    seed_prompt = shared + random_tokens(8, vocab, generator)  # puts the shared prefix in
    warm = [shared + random_tokens(8, vocab, generator) for _ in range(args.repeat)]
    cold = [random_tokens(args.prefix + 8, vocab, generator) for _ in range(args.repeat + 1)]
    rows, warm_tokens = [], {}
    for caching in (True, False):
        with LLM(module, max_num_seqs=4, block_size=16, enable_prefix_caching=caching) as llm:
            def ttft(prompt: list[int]) -> tuple[float, int, list[int]]:
                out = llm.generate([prompt], SamplingParams(max_tokens=1))[0]
                return (1e3 * out.time_to_first_token, out.num_cached_tokens,
                        out.outputs[0].token_ids)

            ttft(cold[-1])  # warm-up (first runs of the programs)
            ttft(seed_prompt)
            cases = {"cold": [], "warm": []} if caching else {"repeated": []}
            for i in range(args.repeat):  # interleaved, so load drifts hit both alike
                for case in cases:
                    cases[case].append(ttft(cold[i] if case == "cold" else warm[i]))
            warm_tokens[caching] = [t for _, _, t in cases["warm" if caching else "repeated"]]
            for case, samples in cases.items():
                rows.append({"caching": caching, "case": case, "prompt_tokens": args.prefix + 8,
                             "ttft_ms_median": statistics.median(t for t, _, _ in samples),
                             "cached_tokens": samples[-1][1]})
    return rows, warm_tokens[True] == warm_tokens[False]


def decode_while_long_prompts_arrive(engine, shorts, longs, every: int):
    """Short requests decode 64 tokens each; a long prompt arrives every ``every`` steps.
    Returns the short streams' inter-token gaps (ms), the long prompts' TTFTs (ms), every
    request's tokens and the steps taken."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=64, ignore_eos=True)) for p in shorts]
    long_ids, gaps, last, seen = [], [], {}, {i: 0 for i in ids}
    finished, step = {}, 0
    while engine.has_unfinished_requests():
        if len(long_ids) < len(longs) and step % every == every - 1:
            long_ids.append(engine.add_request(longs[len(long_ids)],
                                               SamplingParams(max_tokens=4)))
        for out in engine.step():
            finished[out.request_id] = out
        now = time.perf_counter()
        step += 1
        for request_id in ids:  # a stream's token count grew: a token came out now
            request = engine.requests[request_id]
            seqs = request.seqs or request.finished_seqs
            count = seqs[0].num_generated if seqs else 0
            if count > seen[request_id]:
                if request_id in last:
                    gaps.append(1e3 * (now - last[request_id]))
                last[request_id], seen[request_id] = now, count
    long_ttft = [1e3 * finished[i].time_to_first_token for i in long_ids]
    tokens = [finished[i].outputs[0].token_ids for i in ids + long_ids]
    return gaps, long_ttft, tokens, step


def chunked_prefill(module, vocab: int, args) -> tuple[list[dict], bool]:
    """Inter-token latency of decoding streams while long prompts arrive. Each budget runs the
    scenario once to warm up (the step shapes it meets are specialized then), then measures."""
    rows, outputs = [], []
    for budget in (None, args.budget):
        generator = torch.Generator().manual_seed(args.seed + 1)
        shorts = [random_tokens(8, vocab, generator) for _ in range(args.streams)]
        longs = [random_tokens(args.long, vocab, generator) for _ in range(args.long_prompts)]
        with LLM(module, max_num_seqs=args.streams + args.long_prompts, block_size=16,
                 enable_prefix_caching=False, max_num_batched_tokens=budget) as llm:
            decode_while_long_prompts_arrive(llm.engine, shorts, longs, args.every)  # warm-up
            gaps, long_ttft, tokens, steps = decode_while_long_prompts_arrive(
                llm.engine, shorts, longs, args.every)
        outputs.append(tokens)
        rows.append({"max_num_batched_tokens": budget, "streams": args.streams,
                     "long_prompts": len(long_ttft), "long_tokens": args.long,
                     "itl_ms_p50": percentile(gaps, 0.5), "itl_ms_p99": percentile(gaps, 0.99),
                     "itl_ms_max": max(gaps), "long_ttft_ms_median": statistics.median(long_ttft),
                     "steps": steps})
    return rows, outputs[0] == outputs[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefix", type=int, default=768, help="shared prefix tokens")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--streams", type=int, default=4, help="decoding short requests")
    parser.add_argument("--long", type=int, default=768, help="tokens of each long prompt")
    parser.add_argument("--long-prompts", type=int, default=3)
    parser.add_argument("--every", type=int, default=12, help="steps between long prompts")
    parser.add_argument("--budget", type=int, default=128,
                        help="max_num_batched_tokens of the chunked run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).with_name("prefix_chunk.json")))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    example = get_model("gpt", "tiny", seq_len=args.context, d_model=args.d_model,
                        n_layers=args.layers, n_heads=max(1, args.d_model // 64))
    module, vocab = example.module, example.config.vocab_size

    cache_rows, cache_same = prefix_cache(module, vocab, args)
    print(f"{'prefix caching':<15} {'case':<9} {'prompt':>7} {'cached':>7} {'TTFT ms':>9}")
    for r in cache_rows:
        print(f"{'on' if r['caching'] else 'off':<15} {r['case']:<9} {r['prompt_tokens']:>7} "
              f"{r['cached_tokens']:>7} {r['ttft_ms_median']:>9.1f}")
    print(f"same tokens with and without caching: {'yes' if cache_same else 'NO'}\n")

    chunk_rows, chunk_same = chunked_prefill(module, vocab, args)
    print(f"{'max batched tokens':<19} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'ITL max ms':>10} "
          f"{'long TTFT ms':>12} {'steps':>6}")
    for r in chunk_rows:
        budget = r["max_num_batched_tokens"]
        print(f"{'none (whole)' if budget is None else budget:<19} {r['itl_ms_p50']:>10.1f} "
              f"{r['itl_ms_p99']:>10.1f} {r['itl_ms_max']:>10.1f} "
              f"{r['long_ttft_ms_median']:>12.1f} {r['steps']:>6}")
    print(f"same tokens with and without chunking: {'yes' if chunk_same else 'NO'}")
    print("all times measured (wall clock, ms); ITL: inter-token latency of the decoding streams")

    result = {
        "benchmark": "prefix_chunk",
        "units": {"ttft_ms": "ms (measured)", "itl_ms": "ms (measured)"},
        "model": {"family": "gpt", "layers": args.layers, "d_model": args.d_model,
                  "context": args.context},
        "options": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "python": sys.version.split()[0], "torch": torch.__version__,
                    "threads": args.threads},
        "prefix_cache": {"rows": cache_rows, "same_tokens": cache_same},
        "chunked_prefill": {"rows": chunk_rows, "same_tokens": chunk_same},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
