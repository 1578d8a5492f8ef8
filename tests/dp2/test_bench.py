"""``dspark-harden bench dp2``: the arrival-skew / post-latest-arrival split of the raw native exchange
(the seed's speed table), on two real processes with the real native channel and gloo."""

from __future__ import annotations

from dspark_harden.dp2 import bench


def test_split_identity_is_exact():
    # own arrival last: post == total; peer last: post + skew == total; anything else is counted
    assert bench.split_mismatches([10, 10, 10], [3, 4, 0], [10, 6, 10]) == 0
    assert bench.split_mismatches([10, 10], [3, 3], [3, 10 - 4]) == 2


def test_bench_reports_the_native_split_per_round_and_checks_every_call():
    res = bench.run(400, rounds=2)
    assert res["iters"] == 400 and res["rounds"] == 2 and res["call"]["identical"]
    assert res["split_checked"] == 2 * 2 * 400 and res["split_mismatches"] == 0
    for key in ("arrival_skew", "post_latest_arrival", "native"):
        assert set(res[key]) == {"p50_us", "p99_us", "mean_us"}, key
        for q in ("p50", "p99", "mean"):
            assert set(res["spread"][f"{key}_{q}_us"]) == {"median", "min", "max"}
    for rnd in res["per_round"]:
        post, native = rnd["post_latest_arrival"], rnd["native"]
        # per call post_latest_arrival <= the native total <= the Python-timed call, so every quantile is too
        assert 0 <= post["p50_us"] <= native["p50_us"] and post["p99_us"] <= native["p99_us"]
        assert rnd["arrival_skew"]["mean_us"] >= 0
    assert bench.run.__defaults__[0] == 20000  # the seed's 20,000 iterations


def test_cli_default_is_the_seeds_20000_iterations():
    import argparse

    from dspark_harden.dp2 import feature

    root = argparse.ArgumentParser()
    sub = root.add_subparsers()
    bench_sub = sub.add_parser("bench").add_subparsers()
    feature.dspark_cli(subparsers=sub, bench_subparsers=bench_sub)
    args = root.parse_args(["bench", "dp2"])
    assert args.iters == 20000 and args.rounds == 5
