"""HTTP serving benchmark: `graphpar serve` under a bounded Poisson load over 127.0.0.1, beside
Hugging Face ``generate()`` in static batches, on the CPU.

* **server**: ``graphpar serve MODEL`` in a subprocess (``--max-num-seqs`` = batch, one torch
  thread), driven by the official ``openai`` async client: ``--requests`` requests, streamed,
  arriving as a Poisson process at each ``--rates`` (requests/s; ``inf``: all at time 0).
  Measured per request at the client: time to first token (TTFT: send to the first streamed
  token), time per output token (TPOT: (last token - first token) / (tokens - 1)), and the
  run's throughput (generated tokens / seconds from the first send to the last token).
* **HF generate**: the same model object in this process, ``model.generate`` greedy on the same
  prompts in static batches of ``--batch`` in arrival order, left-padded, each batch decoded to
  its longest requested output (``min_new_tokens = max_new_tokens``), all requests at time 0.
* **prefix cache**: TTFT of a request whose long prompt was just served (warm) against a fresh
  prompt of the same length (cold), median of ``--repeat`` pairs.
* **long prompts arrive**: 4 streams decoding 120 tokens each while 3 prompts of 200 tokens
  arrive (at 1, 1.5 and 2 s), on a server that prefills prompts whole and on one with
  ``--max-num-batched-tokens`` ``--chunk``: the streams' time between tokens (p50, p99, the
  longest gap) and the long prompts' TTFT.

Workload: tools/bench/serve.py's Alpaca-like lengths (log-normal, means 19.3 prompt and 58.5
output tokens), clipped to the model's context; random token ids; every request asks for its
exact output length (``ignore_eos``). The model is a randomly initialised Hugging Face GPT-2
(``MODEL_FILE`` below: 4 layers, 256 wide, 256 positions, 256-token vocabulary), so both sides
run the same weights. Prints a table and writes ``serve_http.json`` next to this file (or
``--out``).

    python tools/bench/serve_http.py                       # rates 2, 8, inf; 48 requests
    python tools/bench/serve_http.py --rates 4,inf --requests 32 --batch 8 --out r.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from graphpar.calibration.calibrate import cpu_model

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MODEL_FILE = """\
import torch
import transformers


def build():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=256,
                                     vocab_size=256, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    return model, (torch.randint(0, 256, (1, 8)),)
"""


def _workload(requests: int, context: int, seed: int):
    spec = importlib.util.spec_from_file_location("serve_bench", HERE / "serve.py")
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    return serve.workload(requests, 256, context, seed)



class Server:
    def __init__(self, model_file: Path, batch: int, *options: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "graphpar.cli", "serve", str(model_file), "--port", "0",
             "--threads", "1", "--max-num-seqs", str(batch), "--served-model-name", "bench",
             *options], env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.url = None
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                found = re.search(r"serving \S+ on (http://\S+) ", line)
                if found:
                    self.url = found.group(1)
                    ready.set()
            ready.set()
        threading.Thread(target=read, daemon=True).start()
        ready.wait(600)
        if self.url is None:
            raise SystemExit("the server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


async def _one(client, prompt: list[int], tokens: int, delay: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    sent = time.perf_counter()
    times = []
    stream = await client.completions.create(
        model="bench", prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
        logprobs=0, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
            times.extend([time.perf_counter()] * len(chunk.choices[0].logprobs.tokens))
    return {"sent": sent, "first": times[0], "last": times[-1], "tokens": len(times),
            "times": times}


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def _load(url: str, prompts, lengths, rate: float, seed: int) -> dict:
    import openai

    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(prompts)) if rate == float("inf") else rng.exponential(1 / rate,
                                                                              len(prompts))
    arrivals = np.cumsum(gaps) - gaps[0]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                timeout=600)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_one(client, p, n, float(a), t0)
                                     for p, n, a in zip(prompts, lengths, arrivals)))
    await client.close()
    ttft = [r["first"] - r["sent"] for r in results]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in results)
    seconds = max(r["last"] for r in results) - min(r["sent"] for r in results)
    return {"rate_req_per_s": rate if rate != float("inf") else "inf", "requests": len(results),
            "generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99)}


async def _prefix_ttft(url: str, context: int, repeat: int, seed: int) -> dict:
    import openai

    rng = np.random.default_rng(seed + 1)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    length = context // 2
    cold, warm = [], []
    for _ in range(repeat):
        prompt = rng.integers(1, 256, length).tolist()
        for bucket in (cold, warm):  # the same prompt twice: the second may reuse its blocks
            r = await _one(client, prompt, 2, 0.0, time.perf_counter())
            bucket.append(r["first"] - r["sent"])
    await client.close()
    return {"prompt_tokens": length, "cold_ttft_p50_s": statistics.median(cold),
            "warm_ttft_p50_s": statistics.median(warm)}


async def _long_prompts_arrive(url: str, seed: int) -> dict:
    """Decode streams running while long prompts arrive: the streams' time per output token
    (p50, p99) and longest gap between two tokens, and the long prompts' TTFT."""
    import openai

    rng = np.random.default_rng(seed + 2)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                timeout=600)
    t0 = time.perf_counter()
    decodes = [_one(client, rng.integers(1, 256, 8).tolist(), 120, 0.0, t0) for _ in range(4)]
    longs = [_one(client, rng.integers(1, 256, 200).tolist(), 2, 1.0 + 0.5 * i, t0)
             for i in range(3)]
    results = await asyncio.gather(*decodes, *longs)
    await client.close()
    gaps = [b - a for r in results[:4] for a, b in zip(r["times"], r["times"][1:])]
    return {"decode_tpot_p50_s": _pct(gaps, 50), "decode_tpot_p99_s": _pct(gaps, 99),
            "decode_max_gap_s": max(gaps),
            "long_prompt_ttft_p50_s": statistics.median(r["first"] - r["sent"]
                                                        for r in results[4:])}


def _load_model(model_file: Path):
    import torch

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("bench_model", model_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build()[0]


def _hf_generate(model, prompts, lengths, batch: int) -> dict:
    import torch

    start = time.perf_counter()
    tokens = 0
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            group, outs = prompts[i:i + batch], lengths[i:i + batch]
            width = max(len(p) for p in group)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            new = max(outs)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)
            tokens += sum(outs)  # the tokens requests asked for; the rest of a batch is waste
    seconds = time.perf_counter() - start
    return {"batch": batch, "generated_tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds}


def _engine_in_process(llm, prompts, lengths) -> dict:
    """The engine without the HTTP hop: ``LLM.generate`` on every request at time 0."""
    from graphpar.serving.sampling import SamplingParams

    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def _median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="2,8,inf", help="request rates, requests/s")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3,
                        help="prefix-cache pairs, and runs of each side of the all-at-once "
                             "throughput comparison (interleaved; the median is reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=64, metavar="N",
                        help="chunked prefill's budget (--max-num-batched-tokens) for the "
                             "long-prompts run; 0: skip that run")
    parser.add_argument("--out", default=str(HERE / "serve_http.json"))
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    context = 256
    prompts, lengths = _workload(args.requests, context, args.seed)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model_file = Path(tmp) / "gpt2_bench.py"
        model_file.write_text(MODEL_FILE)
        from graphpar.serving.llm import LLM

        model = _load_model(model_file)
        llm = LLM(model, max_num_seqs=args.batch)
        server = Server(model_file, args.batch)
        try:
            asyncio.run(_load(server.url, prompts[:4], [2] * 4, float("inf"), 0))  # warm up
            _engine_in_process(llm, prompts, lengths)
            _hf_generate(model, prompts[:args.batch], lengths[:args.batch], args.batch)
            # Every request at once, the three sides interleaved so that other load hits
            # them alike; each side's median run is reported.
            runs = []
            for _ in range(args.repeat):
                runs.append({
                    "http": asyncio.run(_load(server.url, prompts, lengths, float("inf"),
                                              args.seed)),
                    "hf_generate": _hf_generate(model, prompts, lengths, args.batch),
                    "engine": _engine_in_process(llm, prompts, lengths)})
            loads = [asyncio.run(_load(server.url, prompts, lengths, r, args.seed))
                     for r in rates if r != float("inf")]
            loads.append(_median_run([r["http"] for r in runs]))
            prefix = asyncio.run(_prefix_ttft(server.url, context, args.repeat, args.seed))
        finally:
            server.stop()
        chunked = {}
        for budget in ((None, args.chunk) if args.chunk else ()):
            options = () if budget is None else ("--max-num-batched-tokens", str(budget))
            server = Server(model_file, args.batch, *options)
            try:
                asyncio.run(_load(server.url, prompts[:4], [2] * 4, float("inf"), 0))
                chunked["whole" if budget is None else f"chunks of {budget}"] = asyncio.run(
                    _long_prompts_arrive(server.url, args.seed))
            finally:
                server.stop()
    hf = _median_run([r["hf_generate"] for r in runs])
    engine = _median_run([r["engine"] for r in runs])
    result = {"cpu": cpu_model(), "cores": os.cpu_count(), "model": "HF GPT-2, 4 layers, 256 wide",
              "batch": args.batch, "requests": args.requests, "server": loads,
              "hf_generate": hf, "engine_in_process": engine,
              "all_at_once_runs": [{side: round(r[side]["tokens_per_s"], 1) for side in r}
                                   for r in runs],
              "speedup_over_hf": {"http": loads[-1]["tokens_per_s"] / hf["tokens_per_s"],
                                  "in_process": engine["tokens_per_s"] / hf["tokens_per_s"]},
              "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
              "prefix_cache": prefix, "long_prompts_arrive": chunked,
              "note": "measured (clock); server figures at the client over 127.0.0.1; the "
                      "all-at-once rows (rate inf, HF generate, engine in process) are "
                      f"medians of {args.repeat} interleaved runs"}
    print(f"CPU: {result['cpu']} ({result['cores']} cores); batch {args.batch}, "
          f"{args.requests} requests; load average {load_before[0]:.1f} before, "
          f"{result['load_average_1m']['after']:.1f} after")
    print("| system | rate (req/s) | tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (s) |")
    print("|---|---|---|---|---|")
    for row in loads:
        print(f"| graphpar serve | {row['rate_req_per_s']} | {row['tokens_per_s']:.0f} | "
              f"{row['ttft_p50_s']:.3f} / {row['ttft_p99_s']:.3f} | "
              f"{row['tpot_p50_s']:.4f} / {row['tpot_p99_s']:.4f} |")
    print(f"| engine in process (LLM.generate) | inf | {engine['tokens_per_s']:.0f} | - | - |")
    print(f"| HF generate, static batches of {args.batch} | inf | {hf['tokens_per_s']:.0f} "
          f"| - | - |")
    print(f"all at once, over HF generate: {result['speedup_over_hf']['http']:.2f}x through "
          f"HTTP, {result['speedup_over_hf']['in_process']:.2f}x in process; runs (tok/s): "
          f"{result['all_at_once_runs']}")
    print(f"prefix of {prefix['prompt_tokens']} tokens: TTFT cold {prefix['cold_ttft_p50_s']:.3f}"
          f" s, warm {prefix['warm_ttft_p50_s']:.3f} s (median of {args.repeat})")
    for name, row in chunked.items():
        print(f"4 decodes while 3 prompts of 200 tokens arrive, prefill {name}: decode TPOT "
              f"p50 {row['decode_tpot_p50_s'] * 1000:.0f} ms, p99 "
              f"{row['decode_tpot_p99_s'] * 1000:.0f} ms, longest gap "
              f"{row['decode_max_gap_s'] * 1000:.0f} ms; long prompts' TTFT p50 "
              f"{row['long_prompt_ttft_p50_s']:.3f} s")
    out = Path(args.out)
    staged = out.with_name(out.name + ".tmp")
    staged.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(staged, out)  # atomically: a reader never sees half a file
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
