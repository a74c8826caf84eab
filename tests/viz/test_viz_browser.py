"""graphpar viz in a real browser: headless Chromium, no network, renders nodes and draws pixels.

Needs Chromium: `/usr/bin/chromium`, or `chromium` / `chromium-browser` / `google-chrome` on
PATH, or the path in $GRAPHPAR_CHROMIUM. Without one these tests are skipped (Debian/Ubuntu:
`apt-get install -y chromium`).
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from viz_graphs import gpt_training_graph, interleaved_graph, mlp_graph, sharded_program

from graphpar.ir.graph import Program
from graphpar.viz import write_html

pytestmark = pytest.mark.browser

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]
BACKGROUND = (0xF7, 0xF8, 0xFA)  # --bg in page.css
MATMUL_FILL = (0xF8, 0xB2, 0x7C)  # --k-matmul in page.css


def find_chromium() -> str | None:
    candidates = [os.environ.get("GRAPHPAR_CHROMIUM"), "/usr/bin/chromium"]
    candidates += [shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@pytest.fixture(scope="module")
def chromium() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip("headless Chromium not found: looked for $GRAPHPAR_CHROMIUM, "
                    "/usr/bin/chromium, and chromium, chromium-browser, google-chrome on PATH "
                    "(install it with `apt-get install -y chromium`)")
    return path


def run_chromium(chromium: str, tmp_path: Path, *runs: tuple[str, ...]) -> list[str]:
    """Chromium once per run (URL, then flags), all at the same time; their standard outputs."""
    procs = []
    for url, *args in runs:
        profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
        profile.mkdir()
        cmd = [chromium, *FLAGS, f"--user-data-dir={profile}", "--window-size=1400,900", *args,
               url]
        procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            text=True)))
    outputs = []
    for cmd, proc in procs:
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{err[-2000:]}"
        outputs.append(out)
    return outputs


def checked_dom(dom: str) -> str:
    assert 'data-ready="true"' in dom, "the page script did not finish"
    error = re.search(r'data-error="([^"]*)"', dom)
    assert error is None, f"script error in the page: {error.group(1)}"
    return dom


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB or RGBA PNG, without dependencies."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, f"unsupported PNG {header}"
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(b"".join(idat))
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        if kind == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 0xFF
        elif kind == 2:
            line = bytearray((a + b) & 0xFF for a, b in zip(line, prev))
        elif kind == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif kind == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b, c = prev[i], prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line) if bpp == 3 else bytes(v for i, v in enumerate(line) if i % 4 != 3))
        prev = line
    return width, height, rows


def test_page_renders_nodes_in_headless_chromium(chromium, tmp_path):
    graph = gpt_training_graph(layers=1)
    page = write_html(graph, tmp_path / "graph.html")
    png = tmp_path / "graph.png"
    _, dom = run_chromium(chromium, tmp_path, (page.as_uri(), f"--screenshot={png}"),
                          (page.as_uri() + "#expand", "--dump-dom"))
    assert png.exists() and png.stat().st_size > 10_000

    width, height, rows = read_png(png)
    assert (width, height) == (1400, 900)
    pixels = [row[i:i + 3] for row in rows[::3] for i in range(0, len(row), 9)]
    colors = set(pixels)
    drawn = sum(p != bytes(BACKGROUND) and p != b"\xff\xff\xff" for p in pixels) / len(pixels)
    assert len(colors) > 30, f"only {len(colors)} colors: a blank page?"
    assert drawn > 0.05, f"only {drawn:.1%} of the pixels are drawn"
    assert bytes(MATMUL_FILL) in colors, "no matmul node was painted"

    dom = checked_dom(dom)
    nodes = re.findall(r'<g class="node [^"]*" data-key="n(\d+)"', dom)
    assert sorted(map(int, nodes)) == list(range(len(graph))), "every node is drawn when expanded"
    assert len(re.findall(r'<path class="edge', dom)) > len(graph) // 2
    assert re.search(r'<g class="cluster[^"]*" data-key="g\d+"', dom)
    assert "blocks.0" in dom and "forward" in dom and "backward" in dom


def test_big_graphs_open_collapsed_and_expand_fast(chromium, tmp_path):
    graph = gpt_training_graph(layers=24)  # about 2,700 nodes: a 24-layer training step
    assert len(graph) > 2500
    page = write_html(graph, tmp_path / "big.html")
    collapsed, expanded = map(checked_dom, run_chromium(
        chromium, tmp_path, (page.as_uri(), "--dump-dom"),
        (page.as_uri() + "#expand", "--dump-dom")))
    dom = collapsed
    boxes = re.findall(r'<g class="group-box[^"]*" data-key="g\d+"', dom)
    assert len(boxes) >= 24, "the blocks start as collapsed groups"
    drawn = int(re.search(r'data-items="(\d+)"', dom).group(1))
    assert drawn < 400, f"{drawn} items drawn before any click"

    dom = expanded
    assert len(re.findall(r'<g class="node ', dom)) == len(graph)
    ms = float(re.search(r'data-render-ms="([\d.]+)"', dom).group(1))
    assert ms < 5000, f"laying out and drawing {len(graph)} nodes took {ms:.0f} ms"


def test_every_control_runs_without_errors(chromium, tmp_path):
    program = Program.of([gpt_training_graph(layers=1), *sharded_program(), interleaved_graph()])
    page = write_html(program, tmp_path / "selftest.html",
                      node_info=lambda node: {"time (est.)": "0.2 ms", "note": "<b>&</b>"})
    (dom,) = run_chromium(chromium, tmp_path, (page.as_uri() + "#selftest", "--dump-dom"))
    checked_dom(dom)
    assert 'data-selftest="ok"' in dom


def test_groups_that_take_turns_are_laid_out(chromium, tmp_path):
    graph = interleaved_graph()
    page = write_html(graph, tmp_path / "interleaved.html")
    (dom,) = map(checked_dom, run_chromium(chromium, tmp_path,
                                           (page.as_uri() + "#expand", "--dump-dom")))
    assert len(re.findall(r'<g class="node ', dom)) == len(graph)
    assert re.search(r'<path class="edge back"', dom), "the cycle between groups is broken"


def test_programs_layouts_and_collectives(chromium, tmp_path):
    program = sharded_program()
    page = write_html(Program.of([*program, mlp_graph()]), tmp_path / "program.html")
    (dom,) = map(checked_dom, run_chromium(chromium, tmp_path,
                                           (page.as_uri() + "#graph=1", "--dump-dom")))
    tabs = re.findall(r'<button type="button" data-tab="(\d)"( class="active")?', dom)
    assert [(t, bool(a)) for t, a in tabs] == [("0", False), ("1", True), ("2", False)]
    assert "stage=1 device=gpu1" in dom
    assert re.search(r'<g class="node k-collective collective', dom), "collective not marked"
    assert "{S(0),P}" in dom and "{S(0),R}" in dom
    assert 'data-q="layout:{S(0),R}"' in dom, "graphs with layouts are colored by layout"


def test_pipeline_view_draws_bands_and_transfers(chromium, tmp_path):
    from test_viz_pipeline import THREE_STAGES

    from graphpar.ir.parser import parse_program
    from graphpar.viz.stages import SUBMESH_PALETTE

    page = write_html(parse_program(THREE_STAGES), tmp_path / "pipeline.html")
    dom, selftest = run_chromium(chromium, tmp_path, (page.as_uri(), "--dump-dom"),
                                 (page.as_uri() + "#selftest", "--dump-dom"))
    dom = checked_dom(dom)  # an MPMD program opens on its pipeline view
    assert 'data-selftest="ok"' in checked_dom(selftest)
    bands = re.findall(r'<g class="band" data-stage="(\d)" data-submesh="(\d)"', dom)
    assert bands == [("0", "0"), ("1", "1"), ("2", "2")]
    assert sorted(re.findall(r'<g class="stage-graph ph-(\w+)" data-graph="(\d)"', dom)) == [
        ("forward", "0"), ("forward", "2"), ("forward", "3"), ("update", "1"), ("update", "4")]
    # one arrow per pair of graphs: 0→2 (two values), 2→3 (two), 4→1 (the update's gradient)
    arrows = re.findall(r'<g class="transfer ph-(\w+)" data-src="(\d)" data-dst="(\d)"', dom)
    assert sorted(arrows) == [("forward", "0", "2"), ("forward", "2", "3"),
                              ("update", "4", "1")]
    assert "1 unmatched" in dom and "devices 1-2" in dom
    stripes = re.findall(r'<rect x="0" y="\d+" width="8" height="\d+" rx="3" '
                         r'style="fill:\s*(#\w+)', dom)
    assert stripes == list(SUBMESH_PALETTE[:3]), "each band is drawn in its sub-mesh colour"
