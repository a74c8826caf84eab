"""`graphpar compile --lower cuda`: the listing files, the kernels, the report; `graphpar dump`
reads a listing back; an op with no CUDA lowering is a clear error."""

from __future__ import annotations

import json

from test_cli import EXAMPLE, run_cli, write_model

from graphpar.ir.cuda_listing import parse_listing


def test_lower_cuda_writes_listings_kernels_and_the_memory_report(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, _ = run_cli(capsys, "compile", EXAMPLE, "--lower", "cuda", "--out", out)
    assert code == 0
    text = (out / "cuda" / "rank0.calls").read_text()
    listing = parse_listing(text)
    assert [c.kind for c in listing.calls] == ["cublas.gemmEx", "kernel.pointwise",
                                               "cublas.gemmEx", "kernel.pointwise"]
    kernels = sorted(p.stem for p in (out / "cuda" / "kernels").glob("*.cu"))
    assert kernels == sorted(listing.kernels())
    report = json.loads((out / "report.json").read_text())["cuda"]
    assert report["calls_by_kind_rank0"] == {"cublas.gemmEx": 2, "kernel.pointwise": 2}
    assert report["arena_bytes_planned"] == [listing.arena_bytes]
    assert report["arena_lower_bound_bytes"] == [listing.lower_bound_bytes]
    assert "arena" in stdout and "lower bound" in stdout
    code, dumped, _ = run_cli(capsys, "dump", out / "cuda" / "rank0.calls")
    assert code == 0 and dumped == text


def test_an_op_without_cuda_lowering_is_a_clear_error(tmp_path, capsys):
    model = write_model(tmp_path, """
        class M(nn.Module):
            def forward(self, x):
                return torch.argmax(x, 1)

        def build():
            return M(), (torch.randn(2, 8),)
    """)
    code, _, err = run_cli(capsys, "compile", model, "--lower", "cuda", "--out", tmp_path / "o")
    assert code != 0
    assert "argmax" in err and "no CUDA lowering" in err
