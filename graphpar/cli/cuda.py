"""`graphpar compile --lower cuda`: write each device's CUDA listing and kernels, and report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphpar.ir.cuda_listing import Listing


def device_listings(result, compiled=None) -> list[Listing]:
    """Each device's listing: of the device program when the compile has a mesh (`compiled`),
    else of the one graph (what a `lower-cuda` pass left, or lowered now)."""
    if compiled is not None:
        return compiled.cuda_listings()
    from graphpar.passes.lower_cuda import CudaListings, lower_to_listing

    made = result.context.result(CudaListings).get(result.graph.name)
    return made if made else [lower_to_listing(result.graph)]


def write_listings(listings: list[Listing], directory: Path) -> None:
    """`directory/rank<R>.calls` per device and `directory/kernels/<name>.cu` per kernel
    (each compiles on its own: the prelude and the kernel)."""
    from graphpar.backends.cuda.codegen import PRELUDE, kernel_source
    from graphpar.ir.cuda_listing import print_listing

    kernels = directory / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    for listing in listings:
        (directory / f"rank{listing.rank}.calls").write_text(print_listing(listing))
        for call in listing.calls:
            path = kernels / f"{call['name']}.cu" if call.kind.startswith("kernel.") else None
            if path is not None and not path.exists():
                path.write_text(PRELUDE + "\n" + kernel_source(call))


def cuda_report(listings: list[Listing]) -> dict[str, Any]:
    """Calls by kind, generated kernels, and the planned memory of every device."""
    kinds: dict[str, int] = {}
    for kind, n in listings[0].calls_by_kind().items():
        kinds[kind] = n
    return {
        "calls_by_kind_rank0": kinds,
        "calls_per_device": [len(listing.calls) for listing in listings],
        "generated_kernels": len({k for listing in listings for k in listing.kernels()}),
        "arena_bytes_planned": [listing.arena_bytes for listing in listings],
        "arena_lower_bound_bytes": [listing.lower_bound_bytes for listing in listings],
        "state_bytes": [listing.state_bytes for listing in listings],
    }


def print_cuda_report(report: dict[str, Any]) -> None:
    kinds = ", ".join(f"{k} {n}" for k, n in report["calls_by_kind_rank0"].items())
    print(f"  cuda       {report['calls_per_device'][0]} calls on device 0 ({kinds}); "
          f"{report['generated_kernels']} generated kernels")
    for rank, (planned, bound) in enumerate(zip(report["arena_bytes_planned"],
                                                report["arena_lower_bound_bytes"])):
        measured = report.get("arena_bytes_measured")
        seen = f", {measured[rank]} B written (measured)" if measured else ""
        print(f"             device {rank}: arena {planned} B planned, lower bound {bound} B "
              f"({planned / max(bound, 1):.2f}x){seen}")
    if "max_abs_error" in report:
        print(f"             listing run on CPU ranks: max |error| vs eager "
              f"{report['max_abs_error']:.2e}")
        for line in report.get("error_lines", ()):
            print(f"             {line}")
        print(f"  {report['verdict']} (CUDA listings)")
