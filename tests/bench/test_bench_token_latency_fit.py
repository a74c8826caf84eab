"""The latency-fit benchmark measures a small stage, fits Eq. 2.9 and reports the held-back
error; the fitted model reproduces every point without context exactly (t(l, 0) is the
measured table) and its context term comes from the points with context."""

import json
import math


def test_token_latency_fit_bench_quick(load_bench, tmp_path, capsys):
    bench = load_bench("token_latency_fit")
    out = tmp_path / "fit.json"
    assert bench.main(["--quick", "--hidden", "64", "--heads", "2", "--layers", "1",
                       "--seq-len", "384", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert math.isfinite(result["held_back_mean_relative_error"])
    assert len(result["coefficients"]) == 4
    for point in result["points"]:
        assert point["measured_s"] > 0
        if point["context"] == 0:
            assert math.isclose(point["model_s"], point["measured_s"], rel_tol=1e-9)
    assert "held-back mean relative error" in capsys.readouterr().out
