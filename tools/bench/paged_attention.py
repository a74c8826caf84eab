"""Benchmark the paged-attention decode kernel against SDPA on a contiguous cache.

On a CUDA GPU, for each batch size and context length: the kernel's latency (CUDA events,
warm-up, median), the memory bandwidth it achieves (bytes of K/V read plus q/out and block
tables, divided by the latency) as a share of the GPU's peak, and the latency of
``torch.nn.functional.scaled_dot_product_attention`` on a contiguous cache of the same size.
Prints a table and, with ``--out``, writes JSON.

Without a GPU it says so and exits 0 having written nothing; ``--cpu`` instead times the torch
reference on a small configuration, which exercises the script itself.

    python tools/bench/paged_attention.py --out paged_attention.json
    python tools/bench/paged_attention.py --cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from graphpar.ir import paged_reference as reference_paged

# Peak DRAM bandwidth in GB/s (1e9 bytes/s) by device-name fragment; first match wins.
PEAK_GBPS = [
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5 / HBM3
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40 GB
    ("L40S", 864.0),
    ("A10G", 600.0),
]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def peak_gbps(device_name: str) -> float | None:
    """Known peak bandwidth for a device name, or None."""
    for fragment, gbps in PEAK_GBPS:
        if fragment in device_name:
            return gbps
    return None


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds per call: CUDA events on a GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # Queue the sample behind a ~1 ms spin so the events time the GPU work alone, not
            # Python's launch overhead (which would dominate a 10 us kernel).
            if hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(2_000_000)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _paged_inputs(batch, context, args, dtype, device, gen):
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    shape = reference_paged.kv_cache_shape(
        num_blocks, args.block_size, args.num_kv_heads, args.head_size
    )
    key_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    value_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    perm = torch.randperm(num_blocks, device=device, generator=gen)  # scattered physical blocks
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(
        batch, args.num_heads, args.head_size, dtype=dtype, device=device, generator=gen
    )
    return query, key_cache, value_cache, tables, lens


def time_paged(kernels, batch, context, args, dtype, device, gen) -> float:
    """Median seconds of one decode step over a paged cache (CUDA kernel, or the reference)."""
    query, key_cache, value_cache, tables, lens = _paged_inputs(
        batch, context, args, dtype, device, gen
    )
    scale = args.head_size**-0.5
    if kernels is not None:
        out = torch.empty_like(query)

        def step() -> object:
            return kernels.paged_attention(
                query, key_cache, value_cache, tables, lens, scale,
                max_context_len=context, out=out,
            )  # fmt: skip
    else:

        def step() -> object:
            return reference_paged.paged_attention(
                query, key_cache, value_cache, tables, lens, scale
            )

    return time_fn(step, device, args.warmup, args.iters)


def time_sdpa(batch, context, args, dtype, device, gen) -> float:
    """Median seconds of SDPA for one decode token on a contiguous cache of the same size."""
    kv_shape = (batch, args.num_kv_heads, context, args.head_size)
    k = torch.randn(kv_shape, dtype=dtype, device=device, generator=gen)
    v = torch.randn(kv_shape, dtype=dtype, device=device, generator=gen)
    q = torch.randn(batch, args.num_heads, 1, args.head_size, dtype=dtype, device=device)
    scale = args.head_size**-0.5
    gqa = args.num_heads != args.num_kv_heads

    def step() -> object:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)

    return time_fn(step, device, args.warmup, args.iters)


def bytes_moved(batch: int, context: int, args, element_size: int) -> int:
    """Bytes a decode step must move: K and V of every context token, q, out, block tables."""
    kv = 2 * batch * context * args.num_kv_heads * args.head_size * element_size
    q_out = 2 * batch * args.num_heads * args.head_size * element_size
    tables = batch * (-(-context // args.block_size)) * 4 + batch * 4
    return kv + q_out + tables


def run(args) -> dict:
    device = torch.device("cuda" if not args.cpu else "cpu")
    dtype = DTYPES[args.dtype]
    element_size = torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda":
        from graphpar.backends.cuda.paged_attention import default_kernels

        kernels = default_kernels()
        device_name = torch.cuda.get_device_name(device)
        peak = args.peak_gbps or peak_gbps(device_name)
    else:
        kernels = None
        device_name = "cpu (torch reference)"
        peak = args.peak_gbps
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for batch in args.batch:
        for context in args.context:
            moved = bytes_moved(batch, context, args, element_size)
            if moved > args.max_gib * 2**30:
                print(f"skip batch={batch} context={context}: {moved / 2**30:.1f} GiB of K/V")
                continue
            split = kernels is not None and context > kernels.PARTITION_SIZE
            paged_s = time_paged(kernels, batch, context, args, dtype, device, gen)
            sdpa_s = time_sdpa(batch, context, args, dtype, device, gen)
            row = {
                "batch": batch,
                "context": context,
                "split_k": split,
                "bytes": moved,
                "paged_us": paged_s * 1e6,
                "paged_gbps": moved / paged_s / 1e9,
                "sdpa_us": sdpa_s * 1e6,
                "sdpa_gbps": moved / sdpa_s / 1e9,
            }
            if peak:
                row["paged_pct_peak"] = 100 * row["paged_gbps"] / peak
                row["sdpa_pct_peak"] = 100 * row["sdpa_gbps"] / peak
            rows.append(row)
            print_row(row)
    return {
        "benchmark": "paged_attention_decode",
        "device": device_name,
        "peak_gbps": peak,
        "torch": torch.__version__,
        "config": {
            "num_heads": args.num_heads,
            "num_kv_heads": args.num_kv_heads,
            "head_size": args.head_size,
            "block_size": args.block_size,
            "dtype": args.dtype,
            "warmup": args.warmup,
            "iters": args.iters,
        },
        "rows": rows,
    }


HEADER = (
    f"{'batch':>6} {'context':>8} {'split':>5} {'paged us':>10} {'GB/s':>8} {'%peak':>6}"
    f" {'sdpa us':>10} {'GB/s':>8} {'%peak':>6} {'sdpa/paged':>10}"
)


def print_row(row: dict) -> None:
    def pct(key: str) -> str:
        return f"{row[key]:6.1f}" if key in row else f"{'-':>6}"

    print(
        f"{row['batch']:>6} {row['context']:>8} {('yes' if row['split_k'] else 'no'):>5}"
        f" {row['paged_us']:>10.1f} {row['paged_gbps']:>8.1f} {pct('paged_pct_peak')}"
        f" {row['sdpa_us']:>10.1f} {row['sdpa_gbps']:>8.1f} {pct('sdpa_pct_peak')}"
        f" {row['sdpa_us'] / row['paged_us']:>10.2f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=_ints, default=[1, 8, 64, 256])
    parser.add_argument("--context", type=_ints, default=[128, 256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--peak-gbps", type=float, default=None, help="override the peak table")
    parser.add_argument(
        "--max-gib", type=float, default=40.0, help="skip configs whose K/V exceeds this"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="time the torch reference on the CPU (small default config) instead of the kernel",
    )
    args = parser.parse_args(argv)
    if args.cpu:
        defaults = {"batch": [1, 8, 64, 256], "context": [128, 256, 512, 1024, 2048, 4096, 8192]}
        if args.batch == defaults["batch"]:
            args.batch = [1, 4]
        if args.context == defaults["context"]:
            args.context = [128, 512]
        args.warmup, args.iters = min(args.warmup, 1), min(args.iters, 3)
    elif not torch.cuda.is_available():
        print(
            "paged_attention bench: no CUDA GPU visible to torch, nothing measured and nothing "
            "written. Run it on a GPU machine (with CuPy), or pass --cpu to time the torch "
            "reference on a small config."
        )
        return 0
    print(HEADER)
    try:
        result = run(args)
    except Exception as exc:  # BackendError (no CuPy), CompileError, ...
        if type(exc).__module__.startswith("graphpar"):
            print(f"paged_attention bench: {exc}", file=sys.stderr)
            return 1
        raise
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
