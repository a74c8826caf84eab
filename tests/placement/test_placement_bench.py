"""The placement benchmark's comparison: AlpaServe's 99 % quantities never lose to selective
replication's on the same simulator, and the bench says so in its column."""

from graphpar.placement.configs import LayerProfile

# a 0.4 s, 4-layer model of 5.2 GB (the §3.2 shape), priced by the fallback estimate
PROFILE = LayerProfile("m", (0.1,) * 4, (1.3e9,) * 4, (1e6,) * 4)


def test_alpaserve_never_loses_to_selective_replication_in_the_bench(load_bench):
    bench = load_bench("placement")
    st = bench._Setting({f"m{i}": PROFILE for i in range(4)}, 4, 6e9, "gamma")
    rows = bench.compare(st, steps=2)
    sr, alpa = rows["selective-replication"], rows["alpaserve"]
    assert alpa["never_loses"] is True and "never_loses" not in sr
    assert alpa["attainment_at_default"] >= sr["attainment_at_default"]
    for key in ("max_rate_req_s", "max_cv"):  # larger is better; None: never reached
        assert sr[key] is None or alpa[key] >= sr[key]
    for key in ("min_slo_scale", "min_devices"):
        assert sr[key] is None or alpa[key] <= sr[key]
    # one replica per device (6 GB): at the default bursty load the pipelines win
    assert alpa["max_cv"] > (sr["max_cv"] or 0)
