"""Target mode's rounds under timing noise: how often the host's timing noise costs a job a round more.

A round is a solve and a fit (all-MiniLM-L6-v2 at 2x on 2 CPU cores: ~300 s), a latency probe an export and a
timing (~10 s). Whether a job needs one round or more is decided by timings alone once the probes have found
widths inside [MET, AIM] x target, so this simulates the loop (`service.job.targeting.target_loop`, the job's
own code) on a MiniLM-shaped set of width curves (6 layers of 12 heads and 1,536 neurons in steps of 8)
whose true speedup is 1 / (1 - 0.97 s) at a saving s of the prunable cost (session 39's MiniLM probes:
53.2 % -> 2.074x, 61.0 % -> 2.441x), every timing multiplied by exp(N(0, sigma)), and in the "burst" rows
20 % of the timings by a further 1.15 or 1 / 1.15 (a neighbour's job on a shared host). No model is built:
this measures the loop's policy, not ONNX Runtime.

    .venv/bin/python bench/targeting_noise.py [--jobs 400] [--policies before,after]

`before`: a probe in [1, 1.10] x target ends the search and each round is timed once (the policy to session
39); `after`: a probe in [SURE] x target ends it and a round that disagrees with its probe on the window is
timed again (`_second_look`, the median of three).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NOISE = ((0.01, 0.0), (0.03, 0.0), (0.05, 0.0), (0.01, 0.2))  # (sigma, share of timings in a burst)
TARGETS = (1.5, 2.0)
BURST = 1.15


def minilm_curves() -> list:
    from compressor.allocation import LayerCurve, allowed_widths

    out = []
    for i in range(6):
        heads, neurons = allowed_widths(12, 1, 1), allowed_widths(1536, 8, 8)
        out.append(LayerCurve(f"attention{i}", "attention_heads", heads, [(i + 1) * (1 - w / 12) ** 2 for w in heads],
                              cost=4.0))
        out.append(LayerCurve(f"ffn{i}", "ffn_neurons", neurons,
                              [(i + 1.5) * (1 - w / 1536) ** 2 for w in neurons], cost=0.06))
    return out


def one_job(seed: int, sigma: float, burst: float, target: float, after: bool) -> tuple[int, int, bool]:
    """(rounds, timings besides the rounds' first, returned round ok) of one simulated job."""
    from compressor.allocation import total_cost
    from exporters.runtime import Latency
    from service.job import CompressRequest
    from service.job.budgets import Metric
    from service.job.targeting import Round, choose, target_loop

    rng = random.Random(seed)
    curves = minilm_curves()
    full = total_cost(curves)
    timings = {"extra": 0}

    def timed(plan) -> Latency:
        saved = 1 - total_cost(curves, plan) / full
        speedup = math.exp(rng.gauss(0, sigma)) / (1 - 0.97 * saved)
        if burst and rng.random() < burst:
            speedup *= rng.choice([BURST, 1 / BURST])
        return Latency(100.0, 100.0 / speedup, 101.0, 100.0 / speedup + 1, speedup, "cpu", 2, "sim", 5)

    def probe(plan, index):
        timings["extra"] += 1
        return timed(plan)

    def retime(done, index):
        timings["extra"] += 1
        return timed(done.plan)

    def run_round(plan, index, predicted=None, solved=None):
        return Round(plan, None, [], None, None, timed(plan), 1.0, predicted)

    request = CompressRequest(model="m", calibration="c", out_dir="o", target_speedup=target, no_accuracy_budget=True)
    metric = Metric("cosine", True)
    rounds = target_loop(request, curves, run_round, metric, 1.0, lambda line: None, probe=probe,
                         retime=retime if after else None)
    return len(rounds), timings["extra"], choose(request, rounds, metric, 1.0)[1] == "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=400, help="simulated jobs per row (seeds 0..jobs-1)")
    parser.add_argument("--policies", default="before,after")
    args = parser.parse_args()
    import service.job.targeting as targeting

    sure = targeting.SURE
    print("| policy | sigma | burst | target | rounds (mean) | jobs with >1 round | probes + re-timings (mean) | ok |")
    print("|---|---|---|---|---|---|---|---|")
    for policy in args.policies.split(","):
        after = policy == "after"
        targeting.SURE = sure if after else (1.0, targeting.AIM)
        try:
            for sigma, burst in NOISE:
                for target in TARGETS:
                    jobs = [one_job(seed, sigma, burst, target, after) for seed in range(args.jobs)]
                    rounds = [j[0] for j in jobs]
                    print(f"| {policy} | {sigma:.2f} | {burst:.1f} | {target:g} | {statistics.fmean(rounds):.2f} | "
                          f"{sum(r > 1 for r in rounds) / len(rounds):.1%} | "
                          f"{statistics.fmean(j[1] for j in jobs):.1f} | {sum(j[2] for j in jobs) / len(jobs):.1%} |")
        finally:
            targeting.SURE = sure


if __name__ == "__main__":
    main()
