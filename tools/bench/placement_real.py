"""The placement simulator against a real run on CPU processes (docs/placement.md): two MLPs
served one per process vs as a 2-stage pipeline over both, under one Poisson trace, through
graphpar's worker group; measured (wall clock) against simulated mean latency and SLO
attainment (at the SLO scale given and at 1.5, 2 and 3x). The simulator gets fixed costs
calibrated on the same processes first and the service times as the processes delivered
them: per part of the trace, each model's mean, the speed of the process around each
request, and the spread (graphpar.placement.real_check). That is a consistency check of the
simulator's queueing, not a prediction. The predictions are beside it: the simulator given the
means of probes served around each part, and each process calibrated alone before the run.
Also beside it: the part's means held fixed, and each request's own computes. Each run is
repeated with another trace seed. Each run in the JSON keeps its errors by profile
(`errors`, predictive first; what each profile is: `profiles`).

    python tools/bench/placement_real.py                 # 2 runs of 60 s: the idle check
    python tools/bench/placement_real.py --quick         # 1 run of 20 s in 2 parts (a smoke check)
    python tools/bench/placement_real.py --utilisation 0.25 --out x.json  # a loaded machine
    python tools/bench/placement_real.py --errors tools/bench/placement_real.json  # kept runs
    python tools/bench/placement_real.py --server --duration 30  # through `graphpar serve`
    python tools/bench/placement_real.py --server --policy pipeline --quick

With --server the replay goes through the product instead: `graphpar serve --placement` of
two tiny LLMs (gpt:tiny, llama:tiny) on two devices, under both placements of the check: one
model per device group ("simple"), and one group pipelining both models over both devices
(2 stages, "pipeline"; a stage process per device and model). Each request is a real HTTP
completion (16 tokens) sent at its arrival time. Each model's service time is measured
through the same server alone first (sequential requests), the simulator is given those (the
pipeline: two stages of half each, as placed; and, beside it, as the server runs it: one
batch in flight, one stage of the whole), and its mean latency and SLO attainment per policy
are set beside the measured ones. The server batches requests of one model (continuous
batching) where the simulator serves them one at a time, so under load the measured
latencies can be shorter than simulated. Its JSON is placement_real.server.json.

Two worker processes and this one (asleep while they serve): no more processes than two
cores. Report CPU load beside the numbers: on a shared machine the run measures its
neighbours too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from graphpar.calibration.calibrate import cpu_model
from graphpar.errors import GraphparError
from graphpar.placement.real_check import MODELS, real_check
from graphpar.placement.real_compare import PROFILE_NOTES, PROFILES, errors


def _row(mode: str, m: dict, key: str = "simulated") -> str:
    sim, measured = m[f"{key}_mean_s"], m["measured_mean_s"]
    points = (m[f"{key}_attainment"] - m["measured_attainment"]) * 100
    return (f"  {mode:10s} {measured * 1e3:11.1f} ms {sim * 1e3:12.1f} ms "
            f"{(sim / measured - 1) * 100:+6.1f}% {m['measured_attainment'] * 100:12.1f}% "
            f"{m[f'{key}_attainment'] * 100:13.1f}% {points:+7.1f}")


def print_errors(run: dict) -> None:
    """The run's errors by profile: the predictions first, then the consistency checks."""
    print(f"  {'simulator given':14s} {'placement':10s} {'mean latency':>12s} {'SLO points':>11s}")
    for name, by_mode in run["errors"].items():
        for mode, e in by_mode.items():
            points = "-" if e["slo_points"] is None else f"{e['slo_points']:.1f}"
            print(f"  {name:14s} {mode:10s} {e['mean_latency_error_pct']:+11.1f}% {points:>11s}")


def kept_errors(path: Path) -> int:
    """Add `errors` to every run of a kept JSON (from the numbers it kept, by its `profiles`:
    name -> key prefix, as the check of the time named them) and print them."""
    results = json.loads(path.read_text())
    profiles = results.get("profiles", {name: {"key": key, "what": PROFILE_NOTES[name]}
                                        for name, key in PROFILES.items()})
    results["profiles"] = profiles
    for r in results["runs"]:
        r["errors"] = errors(r, {name: p["key"] for name, p in profiles.items()})
        print(f"{path.name}, seed {r['seed']}: simulated against measured")
        print_errors(r)
    path.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=None,
                        help="total req/s (default: from --utilisation)")
    parser.add_argument("--utilisation", type=float, default=0.4,
                        help="share of time each process of the simple placement is busy, at "
                             "the calibrated service times (sets the rate)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of trace")
    parser.add_argument("--runs", type=int, default=2, help="runs, each with its own seed")
    parser.add_argument("--slo-scale", type=float, default=5.0)
    parser.add_argument("--segments", type=int, default=4,
                        help="parts the trace is served in, a probe around each")
    parser.add_argument("--probe", type=float, default=4.0,
                        help="seconds of each probe (a profile taken beside each part)")
    parser.add_argument("--quick", action="store_true", help="one run of 20 s in 2 parts")
    parser.add_argument("--keep", default=None,
                        help="write every replay's per-request timestamps to KEEP<seed>.npz")
    parser.add_argument("--out", default=None,
                        help="JSON (default: placement_real.json beside this script)")
    parser.add_argument("--errors", default=None, metavar="JSON",
                        help="run nothing: add the errors by profile to a kept JSON's runs "
                             "(from the numbers it kept) and print them")
    parser.add_argument("--server", action="store_true",
                        help="replay through `graphpar serve --placement` over HTTP (two tiny "
                             "LLMs on two devices: one per device, or both pipelined over "
                             "both) instead of the MLP processes")
    parser.add_argument("--policy", choices=["simple", "pipeline"], default=None,
                        help="with --server: replay through this placement only (default: "
                             "both, one server after the other, the same traces)")
    args = parser.parse_args(argv)
    if args.errors:
        return kept_errors(Path(args.errors))
    if args.server:
        return server_check(args)
    duration, runs, segments = ((20.0, 1, 2) if args.quick
                                else (args.duration, args.runs, args.segments))
    out = Path(args.out or Path(__file__).with_suffix(".json"))
    results = {"machine": platform.node(), "cpus": os.cpu_count(), "cpu_model": cpu_model(),
               "profiles": {name: {"key": key, "what": PROFILE_NOTES[name]}
                            for name, key in PROFILES.items()},
               "runs": []}
    for seed in range(runs):
        load = os.getloadavg()[0]
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            r = real_check(args.rate, duration, args.slo_scale, seed=seed,
                           utilisation=args.utilisation, segments=segments, probe=args.probe,
                           keep=f"{args.keep}{seed}.npz" if args.keep else None)
        except GraphparError as e:
            print(f"placement_real: error: {e}", file=sys.stderr)
            return 2
        r |= {"seed": seed, "load_average_1min_before": load,
              "load_average_1min_after": os.getloadavg()[0],
              "wall_s": time.perf_counter() - wall, "cpu_s_main": time.process_time() - cpu}
        r["errors"] = errors(r)
        results["runs"].append(r)
        s = r["service_s"]
        print(f"run {seed}: {r['requests']} requests at {r['rate']:.3g} req/s over {duration:g} s "
              f"in {r['segments']} parts, a {r['probe_s']:g} s probe around each; load average "
              f"{load:.1f} before, {r['load_average_1min_after']:.1f} after")
        print("  service (mean ms; alone -> in the probes -> in the run): "
              + ", ".join(f"{m} {s['whole'][m] * 1e3:.1f} -> "
                          f"{r['simple']['service_probed_s'][m] * 1e3:.1f} -> "
                          f"{r['simple']['service_in_run_s'][m] * 1e3:.1f}" for m in MODELS)
              + "; stages " + ", ".join(
                  f"{m} " + " + ".join(f"{a * 1e3:.1f}" for a in s['stages'][m]) + " -> "
                  + " + ".join(f"{a * 1e3:.1f}" for a in r['pipeline']['service_probed_s'][m])
                  + " -> "
                  + " + ".join(f"{a * 1e3:.1f}" for a in r['pipeline']['service_in_run_s'][m])
                  for m in MODELS))
        print(f"  fixed costs: send {s['send'] * 1e3:.2f} ms; held send received in "
              f"{s['receive'] * 1e3:.2f} ms ({s['receive_first_busy'] * 1e3:.2f} with stage 1 "
              f"busy, {s['receive_first_idle'] * 1e3:.2f} idle); wake-up lateness "
              + "/".join(f"{t * 1e3:.2f}" for t in s["wake"]) + " ms")
        drift = [[p[m][0] for m in MODELS] for p in r["pipeline"]["service_in_run_by_part_s"]]
        print("  drift: pipeline stage 1 in each part (ms, models a/b): "
              + ", ".join("/".join(f"{t * 1e3:.1f}" for t in d) for d in drift)
              + "; compute CV per rank: " + ", ".join(
                  f"{mode} " + "/".join(f"{c:.2f}" for c in r[mode]["service_cv_in_run"])
                  for mode in ("simple", "pipeline")))
        print("  the simulator's error, predictions (probes, alone) first, then the "
              "consistency checks (replay: the service times the run delivered):")
        print_errors(r)
        print(f"  {'placement':10s} {'measured mean':>14s} {'simulated mean':>15s} {'error':>7s} "
              f"{'measured SLO':>13s} {'simulated SLO':>14s} {'points':>7s}")
        for mode in ("simple", "pipeline"):
            print(_row(mode, r[mode]))
        b = r["pipeline"]["breakdown_s"]
        print("  pipeline, where a request's time went (mean ms): "
              f"to stage 1 {b['to_first_stage'] * 1e3:.2f}, "
              f"stage 1 {b['first_compute'] * 1e3:.2f}, "
              f"wait for stage 2's receive {b['wait_for_receive'] * 1e3:.2f}, hand-over "
              f"{b['handover'] * 1e3:.2f} ({b['handover_second_idle'] * 1e3:.2f} when stage 2 "
              f"waited, {b['handover_second_busy'] * 1e3:.2f} when it was busy: "
              f"{b['second_busy_share'] * 100:.0f} %), stage 2 {b['second_compute'] * 1e3:.2f}; "
              f"compute CV {b['first_compute_cv']:.2f} / {b['second_compute_cv']:.2f}")
        for key, what in (("simulated_fixed", "the part's mean service times, held fixed"),
                          ("simulated_probed", "the probes' mean service times (before and "
                                               "after each part)"),
                          ("simulated_alone", "service times of each process calibrated alone"),
                          ("simulated_per_request", "each request's own compute times")):
            print(f"  the simulator given {what}:")
            for mode in ("simple", "pipeline"):
                print(_row(mode, r[mode], key))
        print("  SLO attainment (%) by SLO scale (x each model's service alone), measured / "
              "simulated / simulated from the probes:")
        for mode in ("simple", "pipeline"):
            by = r[mode]["attainment_by_slo_scale"]
            print(f"  {mode:10s} " + "   ".join(
                f"x{scale}: {a['measured'] * 100:.1f} / {a['simulated'] * 100:.1f} / "
                f"{a['simulated_probed'] * 100:.1f}" for scale, a in by.items()))
        out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


# --- the replay through `graphpar serve --placement` ------------------------------------------

SERVED = {"gpt": "gpt:tiny", "llama": "llama:tiny"}
PROMPT, TOKENS = list(range(1, 9)), 16  # 8 prompt tokens, 16 generated
# the real check's two placements of two models on two devices, as `graphpar place` writes them
SERVER_POLICIES = {
    "simple": [{"devices": [i], "parallel_config": {"stages": 1, "intra_op": 1}, "models": [m]}
               for i, m in enumerate(SERVED)],
    "pipeline": [{"devices": [0, 1], "parallel_config": {"stages": 2, "intra_op": 1},
                  "models": list(SERVED)}],
}


def _start_server(placement: Path, policy: str) -> tuple[object, str]:
    import re
    import subprocess

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    models = [a for name, example in SERVED.items() for a in ("--model", f"{name}={example}")]
    proc = subprocess.Popen([sys.executable, "-m", "graphpar", "serve", "--placement",
                             str(placement), "--policy", policy, *models, "--port", "0",
                             "--threads", "1"], env=env, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        found = re.search(r"serving \S+ on (http://\S+) ", line)
        if found:
            return proc, found.group(1)
    raise SystemExit(f"placement_real: the server did not start (exit {proc.wait()})")


async def _replay(url: str, models: list[str], arrivals: list[float]) -> list[float]:
    """Each request sent at its arrival (seconds from now); its latency, wall clock."""
    import asyncio

    import httpx2

    async with httpx2.AsyncClient(timeout=600) as client:
        start = time.perf_counter()

        async def one(model: str, at: float) -> float:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent = time.perf_counter()
            answer = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                "ignore_eos": True})
            answer.raise_for_status()
            return time.perf_counter() - sent
        return list(await asyncio.gather(*(one(m, a) for m, a in zip(models, arrivals))))


def _sim_groups(policy: str, service: dict[str, float], as_served: bool = False) -> list:
    """The simulator's groups for `policy`, given each model's service time alone. The
    pipeline as placed: two stages of half the time each (a decoder block each), overlapping
    across requests; as served (one batch in flight, the two models' engines taking turns in
    the group's process): one stage of the whole time for both."""
    from graphpar.placement.simulator import SimGroup

    if policy == "simple":
        return [SimGroup({m: [t]}) for m, t in service.items()]
    return [SimGroup({m: [t] if as_served else [t / 2, t / 2] for m, t in service.items()})]


def server_check(args: argparse.Namespace) -> int:
    import asyncio
    import tempfile

    import numpy as np

    from graphpar.placement.simulator import simulate
    from graphpar.placement.workload import gamma_workload

    names = list(SERVED)
    duration = 20.0 if args.quick else args.duration
    policies = [args.policy] if args.policy else list(SERVER_POLICIES)
    tmp = Path(tempfile.mkdtemp(prefix="placement-real-server-"))
    placement = tmp / "placement.json"
    placement.write_text(json.dumps({"devices": 2, "policies": {
        name: {"policy": name, "groups": groups} for name, groups in SERVER_POLICIES.items()}}))
    out = Path(args.out or Path(__file__).with_name("placement_real.server.json"))
    results = {"machine": platform.node(), "cpus": os.cpu_count(), "cpu_model": cpu_model(),
               "server": "graphpar serve --placement, one server per policy",
               "client": "httpx2, each request sent at its arrival time",
               "placements": SERVER_POLICIES, "prompt_tokens": len(PROMPT),
               "completion_tokens": TOKENS, "policies": {}}
    rate = args.rate
    for policy in policies:
        proc, url = _start_server(placement, policy)
        try:
            for m in names:  # warm-up: the first requests of a fresh engine are slower
                asyncio.run(_replay(url, [m] * 3, [0.0, 0.0, 0.0]))
            service = {}
            for m in names:  # alone and one at a time: the simulator's service time
                times = [asyncio.run(_replay(url, [m], [0.0]))[0] for _ in range(10)]
                service[m] = float(np.mean(times))
            if rate is None:  # set by the first policy: every policy replays the same traces
                rate = args.utilisation * sum(1 / service[m] for m in names)
            entry = results["policies"][policy] = {"service_alone_s": service, "runs": []}
            for seed in range(1 if args.quick else args.runs):
                w = gamma_workload(names, rate, 1.0, duration, seed=seed)
                load = os.getloadavg()[0]
                latency = np.array(asyncio.run(_replay(
                    url, [names[i] for i in w.model_ids], [float(a) for a in w.arrivals])))
                run = {"seed": seed, "requests": len(w), "rate": rate, "duration_s": duration,
                       "load_average_1min_before": load,
                       "measured_mean_s": float(latency.mean()),
                       "attainment_by_slo_scale": {}}
                for key, as_served in (("simulated", False), ("simulated_as_served", True)):
                    if key == "simulated_as_served" and policy == "simple":
                        continue
                    groups = _sim_groups(policy, service, as_served)
                    slo = {m: args.slo_scale * service[m] for m in names}
                    sim = simulate(groups, w, slo)
                    run[f"{key}_mean_s"] = sim.mean_latency
                    run[f"{key}_attainment"] = sim.attainment
                    bound = np.array([slo[names[i]] for i in w.model_ids])
                    run["measured_attainment"] = float((latency <= bound).mean())
                    for scale in (1.5, 2.0, 3.0, 5.0):
                        tight = {m: scale * service[m] for m in names}
                        bound = np.array([tight[names[i]] for i in w.model_ids])
                        row = run["attainment_by_slo_scale"].setdefault(str(scale), {
                            "measured": float((latency <= bound).mean())})
                        row[key] = simulate(groups, w, tight).attainment
                entry["runs"].append(run)
                print(f"{policy}, run {seed} through {url}: {len(w)} requests at {rate:.3g} "
                      f"req/s over {duration:g} s; service alone (measured, HTTP) "
                      + ", ".join(f"{m} {service[m] * 1e3:.1f} ms" for m in names)
                      + f"; load average {load:.1f} before")
                print(f"  {'placement':10s} {'measured mean':>14s} {'simulated mean':>15s} "
                      f"{'error':>7s} {'measured SLO':>13s} {'simulated SLO':>14s} "
                      f"{'points':>7s}")
                print(_row(policy, run))
                if policy != "simple":
                    print(_row("as served", run, "simulated_as_served"))
                print("  SLO attainment (%) by SLO scale (x each model's service alone), "
                      "measured / simulated" + (" / simulated as served" if policy != "simple"
                                                else "") + ": " + "   ".join(
                          f"x{k}: " + " / ".join(f"{v * 100:.1f}" for v in a.values())
                          for k, a in run["attainment_by_slo_scale"].items()))
                out.write_text(json.dumps(results, indent=1) + "\n")
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
