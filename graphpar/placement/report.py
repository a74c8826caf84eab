"""placement.html: the groups of each policy's placement and SLO attainment plots, drawn as
SVG by hand (self-contained, no scripts, no network)."""

from __future__ import annotations

import html as _html

_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
_AXIS_TITLES = {"total_rate": "total rate (req/s)", "cv": "CV of inter-arrival times",
                "slo_scale": "SLO scale (× single-device latency)", "devices": "devices"}


def _esc(x: object) -> str:
    return _html.escape(str(x))


def groups_svg(policy: dict, models: list[str]) -> str:
    """One box per device, grouped; a group's label says its config and models."""
    groups = policy["groups"]
    devices = sum(len(g["devices"]) for g in groups) or 1
    width, cell = 900, 900 / devices
    colour = {m: _COLOURS[i % len(_COLOURS)] for i, m in enumerate(models)}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 20}" height="120">']
    for g in groups:
        x = 10 + g["devices"][0] * cell
        w = len(g["devices"]) * cell
        cfg = g["parallel_config"]
        parts.append(f'<rect x="{x:.1f}" y="10" width="{w - 2:.1f}" height="60" fill="#f4f4f4" '
                     f'stroke="#333"><title>devices {g["devices"][0]}-{g["devices"][-1]}: '
                     f'{cfg["stages"]} stages x {cfg["intra_op"]} intra-op; '
                     f'{_esc(", ".join(g["models"]))}</title></rect>')
        band = (w - 6) / max(len(g["models"]), 1)
        for k, m in enumerate(g["models"]):
            parts.append(f'<rect x="{x + 2 + k * band:.1f}" y="40" width="{band - 1:.1f}" '
                         f'height="26" fill="{colour[m]}"><title>{_esc(m)}</title></rect>')
        parts.append(f'<text x="{x + 3:.1f}" y="30" font-size="11">{cfg["stages"]}x'
                     f'{cfg["intra_op"]}</text>')
    for i, m in enumerate(models):
        parts.append(f'<rect x="{10 + i * 120}" y="85" width="12" height="12" '
                     f'fill="{colour[m]}"/><text x="{26 + i * 120}" y="96" '
                     f'font-size="12">{_esc(m)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def line_plot(title: str, sweep: dict) -> str:
    """SLO attainment (%) against one swept quantity, one line per policy."""
    xs = sweep["x"]
    policies = [k for k in sweep if k != "x"]
    w, h, left, bottom = 420, 260, 50, 40
    lo, hi = min(xs), max(xs)
    span = (hi - lo) or 1.0

    def px(x):
        return left + (x - lo) / span * (w - left - 20)

    def py(y):
        return h - bottom - y * (h - bottom - 20)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">',
             f'<line x1="{left}" y1="{py(0)}" x2="{w - 20}" y2="{py(0)}" stroke="#333"/>',
             f'<line x1="{left}" y1="{py(0)}" x2="{left}" y2="{py(1)}" stroke="#333"/>']
    for y in (0, 0.5, 0.99, 1.0):
        parts.append(f'<text x="{left - 4}" y="{py(y) + 4:.1f}" font-size="10" '
                     f'text-anchor="end">{y * 100:g}%</text>')
    for x in xs:
        parts.append(f'<text x="{px(x):.1f}" y="{h - bottom + 14}" font-size="10" '
                     f'text-anchor="middle">{x:g}</text>')
    parts.append(f'<text x="{(w + left) / 2}" y="{h - 6}" font-size="12" '
                 f'text-anchor="middle">{_esc(title)}</text>')
    for i, p in enumerate(policies):
        c = _COLOURS[i % len(_COLOURS)]
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, sweep[p]))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
        for x, y in zip(xs, sweep[p]):
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}">'
                         f'<title>{_esc(p)}: {y * 100:.2f}%</title></circle>')
        parts.append(f'<text x="{left + 8}" y="{20 + 14 * i}" font-size="11" fill="{c}">'
                     f'{_esc(p)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def html(report: dict) -> str:
    """The page for a `PlaceReport.to_json()`."""
    models = list(report["models"])
    body = ["<h1>graphpar placement</h1>",
            f"<p>{report['devices']} devices, {report['memory_per_device_bytes'] / 1e9:.1f} GB "
            f"each for weights; {report['requests']} requests (simulated). Latencies are "
            f"graphpar's estimates.</p>", "<table border=1 cellpadding=4><tr><th>model</th>"
            "<th>latency (est.)</th><th>weights</th><th>SLO</th></tr>"]
    for m, d in report["models"].items():
        body.append(f"<tr><td>{_esc(m)}</td><td>{d['latency_s_est'] * 1e3:.3g} ms</td>"
                    f"<td>{d['weight_bytes'] / 1e9:.2f} GB</td><td>{d['slo_s'] * 1e3:.3g} ms"
                    f"</td></tr>")
    body.append("</table>")
    for name, p in report["policies"].items():
        att = p["slo_attainment"]
        body.append(f"<h2>{_esc(name)}: {att['overall'] * 100:.2f} % within SLO</h2>")
        body.append(groups_svg(p, models))
        per = ", ".join(f"{_esc(m)} {a * 100:.1f} %" for m, a in att["per_model"].items())
        body.append(f"<p>per model: {per}</p>")
    if report["sweeps"]:
        body.append("<h2>SLO attainment</h2><div>")
        for axis, sweep in report["sweeps"].items():
            body.append(line_plot(_AXIS_TITLES.get(axis, axis), sweep))
        body.append("</div>")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>graphpar placement"
            "</title></head><body style='font-family:sans-serif'>" + "\n".join(body)
            + "</body></html>\n")
