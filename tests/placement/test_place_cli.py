"""`graphpar place` and graphpar.place: SPECs, field-level errors, the files written."""

import json
import textwrap

import pytest

import graphpar
from graphpar.cli.main import main
from graphpar.errors import PlacementSpecError
from graphpar.placement.spec import parse_spec

MODEL_FILE = """\
import torch
def build():
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    return m, (torch.randn(2, 64),)
"""

MINIMAL = """\
cluster: {preset: dgx-a100, devices: 16, memory_per_device: 13GB}
models:
  - {name: chat, example: "gpt:1.3B"}
  - {name: search, example: "bert:large"}
  - {name: file, path: my_model.py}      # a model file (build()), as for compile
workload: {arrival: gamma, total_rate: 20, cv: 3, duration: 600, split: {power_law: 0.5}}
# or: workload: {trace: requests.csv}    # columns: model,arrival_s
slo: {scale: 5}                           # or {seconds: 0.5}
policies: [alpaserve, selective-replication]
"""


def _small_spec(tmp_path, **workload):
    (tmp_path / "my_model.py").write_text(MODEL_FILE)
    wl = workload or {"arrival": "gamma", "total_rate": 50, "cv": 3, "duration": 60}
    return {"cluster": {"devices": 4, "memory_per_device": "1GB"},
            "models": [{"name": "lm", "example": "gpt:tiny"},
                       {"name": "file", "path": "my_model.py"}],
            "workload": wl, "slo": {"scale": 5},
            "policies": ["alpaserve", "selective-replication", "round-robin"],
            "plots": {"points": 2}}


def test_place_cli_writes_json_and_html(tmp_path, capsys):
    spec = _small_spec(tmp_path)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert main(["place", str(tmp_path / "spec.json"), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "alpaserve: SLO attainment" in printed and "per model: lm" in printed
    data = json.loads((tmp_path / "out" / "placement.json").read_text())
    alpa, sr = data["policies"]["alpaserve"], data["policies"]["selective-replication"]
    assert alpa["slo_attainment"]["overall"] >= sr["slo_attainment"]["overall"]
    assert set(alpa["slo_attainment"]["per_model"]) == {"lm", "file"}
    assert sorted(d for g in alpa["groups"] for d in g["devices"]) == [0, 1, 2, 3]
    assert set(data["sweeps"]) == {"total_rate", "cv", "slo_scale", "devices"}
    page = (tmp_path / "out" / "placement.html").read_text()
    assert page.count("<svg") == 3 + 4 and "http" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")


def test_graphpar_place_replays_a_trace(tmp_path):
    (tmp_path / "t.csv").write_text("model,arrival_s\n" + "".join(
        f"{'lm' if i % 3 else 'file'},{i * 0.01}\n" for i in range(300)))
    spec = _small_spec(tmp_path, trace="t.csv", warmup=0)
    spec["plots"] = False
    report = graphpar.place(parse_spec(spec, base=tmp_path))
    assert len(report.problem.workload) == 300
    assert report.placements["alpaserve"].attainment == 1.0


@pytest.mark.parametrize("change,message", [
    (lambda s: s["cluster"].pop("devices"), r"spec.cluster.devices: missing"),
    (lambda s: s["cluster"].update(devices=0), r"spec.cluster.devices: expected a positive"),
    (lambda s: s["cluster"].update(memory_per_device="13 gigs"), r"memory_per_device"),
    (lambda s: s["models"][0].update(path="x.py"), r"spec.models\[0\]: give exactly one"),
    (lambda s: s["models"][1].update(path="nope.py"), r"spec.models\[1\].path: .*nope.py"),
    (lambda s: s["workload"].update(cv=-1), r"spec.workload.cv: expected a positive"),
    (lambda s: s["workload"].update(arrival="bursty"), r"spec.workload.arrival: 'bursty'"),
    (lambda s: s.update(policies=["alpaserve", "magic"]), r"spec.policies\[1\]: unknown policy"),
    (lambda s: s.update(slo={"scale": 5, "seconds": 1}), r"spec.slo: give one of"),
    (lambda s: s.update(extra=1), r"spec.extra: unknown field"),
    (lambda s: s["workload"].update(total_rate=float("inf")),
     r"spec.workload.total_rate: expected a positive number, got inf"),
    (lambda s: s["workload"].update(duration=float("nan")),
     r"spec.workload.duration: expected a positive number, got nan"),
    (lambda s: s["workload"].update(cv=1e300), r"spec.workload.cv: 1e\+300 is out of range: "
                                               r"give a positive number from 0.01 to 100"),
    (lambda s: s["cluster"].update(devices=100000), r"spec.cluster.devices: 100000 is out of "
                                                    r"range: give a positive whole number from "
                                                    r"1 to 1024"),
    (lambda s: s["cluster"].update(memory_per_device="1e400GB"), r"memory_per_device"),
    (lambda s: s.update(plots={"points": 100000}), r"spec.plots.points: 100000 is out of range"),
    (lambda s: s["workload"].update(warmup=61), r"spec.workload.warmup: 61 s is not shorter "
                                                r"than the duration \(60 s\)"),
    (lambda s: s["workload"].update(total_rate=1e5), r"spec.workload: about 12,000,000 requests "
                                                     r"\(estimated: total_rate x duration, x2 "
                                                     r"for the plots' rate sweep\), more than "
                                                     r"the 2,000,000"),
    (lambda s: s["workload"].update(arrival="maf2", window=0.001),
     r"spec.workload.window: 0.001 s cuts the 60 s into 60,000 windows"),
    (lambda s: s["models"][0].update(name=5), r"spec.models\[0\].name: expected a name or "
                                              r"text on one line, got 5"),
    (lambda s: s["models"][0].update(example=["gpt"] * 1000), r"spec.models\[0\].example: "
                                                              r"expected a name .{0,100}$"),
])
def test_spec_errors_name_the_field(tmp_path, change, message):
    spec = _small_spec(tmp_path)
    change(spec)
    with pytest.raises(PlacementSpecError, match=message):
        parse_spec(spec, base=tmp_path)


def test_unknown_model_example_fails_without_a_traceback(tmp_path, capsys):
    spec = _small_spec(tmp_path)
    spec["models"][0]["example"] = "gpt:99T"
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert main(["place", str(tmp_path / "spec.json"), "--out", str(tmp_path / "o")]) != 0
    err = capsys.readouterr().err
    assert "gpt:99T" in err and "Traceback" not in err


@pytest.mark.slow
def test_the_issues_minimal_spec_works_as_written(tmp_path, capsys):
    (tmp_path / "my_model.py").write_text(MODEL_FILE)
    (tmp_path / "spec.yaml").write_text(textwrap.dedent(MINIMAL))
    assert main(["place", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "placement.json").read_text())
    assert set(data["policies"]) == {"alpaserve", "selective-replication"}
    assert data["devices"] == 16 and data["memory_per_device_bytes"] == 13e9


def test_a_maf2_like_workload_places(tmp_path):
    spec = _small_spec(tmp_path, arrival="maf2", total_rate=40, duration=120, window=30)
    spec["plots"] = False
    report = graphpar.place(parse_spec(spec, base=tmp_path))
    assert report.problem.workload.duration == 120.0
    assert report.placements["alpaserve"].attainment >= \
        report.placements["selective-replication"].attainment
