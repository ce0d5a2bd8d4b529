"""Solver benchmark (issue: the OSSCAR layer solver) -> numbers for bench/RESULTS.md.

    python bench/solver.py                 # everything (about 10 minutes on 2 cores)
    python bench/solver.py --parts small   # one part: small, real, speed, scratch
    python bench/solver.py --quick         # smaller sizes, for a smoke run

Parts:
  small   objective gap to `exact` on 200 small correlated problems (d1 <= 64, <= 16 groups)
  real    objective increase over f({}) against mp+ and thinet on real layers: ResNet-20 (CIFAR-10
          calibration images) and stories260K (TinyStories tokens), H and G from forward hooks
  speed   time of osscar / time of one float64 Cholesky solve of H^-1 G, same run, interleaved
  scratch gain over recomputing f from scratch for every candidate (sampled and extrapolated)
  search  the "fast solver" issue's problem, which has much to swap: A = randn(rows, d1) (I + 0.05
          randn(d1, d1)), H = A^T A, G = H W_hat; time against one Cholesky solve, the phases,
          the objective against mp+, and ATen ops / host synchronisations per swap round
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compressor import solve_layer
from compressor.solver.counting import OpCounter
from compressor.solver.linalg import cholesky
from compressor.solver.osscar import OsscarConfig, OsscarSolver
from compressor.solver.problem import LayerProblem
from compressor.solver.synthetic import correlated_problem

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
log = logging.getLogger("bench.solver")


def increase(f: float, f0: float) -> float:
    return f - f0


# ---- (a) small problems against exact -----------------------------------------------------------
def part_small(instances: int) -> dict:
    gaps, vs_mp, worse_than_mp = [], [], 0
    configs = [(16, 1), (32, 2), (48, 3), (64, 4), (64, 8), (15, 1)]
    for k in range(instances):
        d1, g = configs[k % len(configs)]
        pb = correlated_problem(d1, 8, g, samples=3 * d1, rank_fraction=0.3, seed=1000 + k)
        p = d1 // g
        num_prune = [p // 4, p // 2, (3 * p) // 4][k % 3]
        f0 = solve_layer(pb.H, pb.G, g, 0, "exact").objective
        ex = solve_layer(pb.H, pb.G, g, num_prune, "exact").objective
        os_ = solve_layer(pb.H, pb.G, g, num_prune, dense_weight=pb.dense_weight).objective
        mp = solve_layer(pb.H, pb.G, g, num_prune, "mp+", dense_weight=pb.dense_weight).objective
        gaps.append((os_ - ex) / max(ex - f0, 1e-300))
        vs_mp.append((os_ - f0) / max(mp - f0, 1e-300))
        worse_than_mp += os_ > mp + 1e-9 * abs(mp)
    return {
        "instances": instances,
        "gap_to_exact_median": statistics.median(gaps),
        "gap_to_exact_p90": float(np.quantile(gaps, 0.9)),
        "gap_to_exact_max": max(gaps),
        "optimal_fraction": sum(g_ <= 1e-9 for g_ in gaps) / len(gaps),
        "increase_vs_mp_plus_median": statistics.median(vs_mp),
        "worse_than_mp_plus": worse_than_mp,
    }


# ---- (a') real layer problems ------------------------------------------------------------------
def resnet20_problems(n_images: int) -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """(name, H, W_hat, group_size) for the second conv of every basic block (the paper's choice)."""
    program = torch.export.load(str(DATA / "resnet-cifar10" / "resnet20.pt2"))
    model = program.module()
    params = {id(p): n for n, p in model.named_parameters()}
    data = np.load(DATA / "cifar10" / "train_prefix_5085.npz")
    x = torch.from_numpy(data["x"][:n_images]).permute(0, 3, 1, 2).float() / 255.0
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    x = (x - mean) / std
    found: dict[str, tuple[torch.Tensor, torch.Tensor, tuple]] = {}

    class Recorder(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target is torch.ops.aten.conv2d.default:
                name = params.get(id(args[1]), "?")
                if name.endswith("conv2.weight"):
                    inp, w = args[0], args[1]
                    stride, padding = args[3], args[4]
                    cols = torch.nn.functional.unfold(inp, w.shape[2:], padding=padding, stride=stride)
                    X = cols.transpose(1, 2).reshape(-1, cols.shape[1]).double()  # (N L, C k k)
                    H = X.T @ X
                    prev = found.get(name)
                    found[name] = (H if prev is None else prev[0] + H, w, ())
            return super().call_function(target, args, kwargs)

    with torch.no_grad():
        for batch in x.split(100):
            Recorder(model).run(batch)
    out = []
    for name, (H, w, _) in found.items():
        W_hat = w.detach().reshape(w.shape[0], -1).T.double()  # (C_in kH kW) x C_out
        out.append((f"resnet20.{name.removesuffix('.weight')}", H, W_hat, w.shape[2] * w.shape[3]))
    return out


def stories_problems(n_stories: int, max_len: int) -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """(name, H, W_hat, group_size) for o_proj (heads) and down_proj (neurons) of every layer."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(DATA / "stories260K")).eval()
    tok = np.load(DATA / "stories260K" / "tinystories-valid-tokens.npz")
    ids, offsets = tok["ids"], tok["offsets"]
    n_cal = min(n_stories, (len(offsets) - 1) // 2)  # the first half of the stories calibrates
    acc: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for name, mod in ((f"stories260K.layers.{i}.o_proj", layer.self_attn.o_proj),
                          (f"stories260K.layers.{i}.down_proj", layer.mlp.down_proj)):
            def hook(_m, inputs, _out, name=name):
                X = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
                acc[name] = acc.get(name, 0) + X.T @ X
            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        for s in range(n_cal):
            story = torch.from_numpy(ids[offsets[s]:offsets[s + 1]][:max_len].astype(np.int64))
            model(story.unsqueeze(0))
    for h in hooks:
        h.remove()
    head_dim = model.config.head_dim
    out = []
    for i, layer in enumerate(model.model.layers):
        o, d = layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight
        for kind, weight, g in (("o_proj", o, head_dim), ("down_proj", d, 1)):
            name = f"stories260K.layers.{i}.{kind}"
            out.append((name, acc[name], weight.detach().T.double(), g))
    return out


def part_real(quick: bool) -> dict:
    if not DATA.exists():
        return {"skipped": f"{DATA} is absent"}
    problems = resnet20_problems(100 if quick else 500) + stories_problems(16 if quick else 110, 256)
    rows = []
    for name, H, W_hat, g in problems:
        G = H @ W_hat  # single-layer problem on dense activations: X = X_hat
        p = H.shape[0] // g
        for ratio in (0.25, 0.5):
            k = round(ratio * p)
            f0 = solve_layer(H, G, g, 0, "mp+", dense_weight=W_hat).objective
            res = {}
            for method in ("mp", "mp+", "thinet", "osscar"):
                start = time.perf_counter()
                sol = solve_layer(H, G, g, k, method, dense_weight=W_hat)
                res[method] = (increase(sol.objective, f0), time.perf_counter() - start)
            if p <= 16:
                res["exact"] = (increase(solve_layer(H, G, g, k, "exact").objective, f0), 0.0)
            rows.append({"layer": name, "groups": p, "group_size": g, "ratio": ratio, "pruned": k,
                         **{f"{m}_increase": v[0] for m, v in res.items()},
                         "osscar_s": res["osscar"][1]})
    os_vs_mp = [r["osscar_increase"] / r["mp+_increase"] for r in rows if r["mp+_increase"] > 0]
    os_vs_th = [r["osscar_increase"] / r["thinet_increase"] for r in rows if r["thinet_increase"] > 0]
    return {
        "layers": rows,
        "osscar_over_mp_plus_median": statistics.median(os_vs_mp),
        "osscar_over_mp_plus_max": max(os_vs_mp),
        "osscar_over_thinet_median": statistics.median(os_vs_th),
        "osscar_over_thinet_max": max(os_vs_th),
        "osscar_worse_than_mp_plus": sum(r["osscar_increase"] > r["mp+_increase"] * (1 + 1e-9) + 1e-12 for r in rows),
    }


# ---- (b) speed against one Cholesky solve ------------------------------------------------------
def cholesky_solve(H: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    return torch.cholesky_solve(G, torch.linalg.cholesky(H))


def lapack_cholesky_solve(H: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """The same solve with the solver's own factorisation (LAPACK potrf + potrs on one copy, on the CPU):
    the baseline without torch's copies, against which the solver's direct LAPACK calls gain nothing."""
    return cholesky(H).solve(G)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def part_speed(sizes: list[int], group_sizes: list[int], repeats: int) -> dict:
    rows = []
    for d1 in sizes:
        for g in group_sizes:
            pb = correlated_problem(d1, d1 // 4, g, seed=d1 + g)
            k = d1 // g // 2
            def solve(pb=pb, g=g, k=k):
                return solve_layer(pb.H, pb.G, g, k, dense_weight=pb.dense_weight)

            def base(pb=pb):
                return cholesky_solve(pb.H, pb.G)

            def lapack(pb=pb):
                return lapack_cholesky_solve(pb.H, pb.G)

            base()  # warm-up: thread pools, allocator
            lapack()
            sol = solve()
            t_base, t_lapack, t_os = [], [], []
            for _ in range(repeats):  # interleaved, so both see the same machine load
                t_base.append(timed(base))
                t_lapack.append(timed(lapack))
                t_os.append(timed(solve))
            ratios = [o / b for o, b in zip(t_os, t_base, strict=True)]
            rows.append({"d1": d1, "d2": d1 // 4, "group_size": g, "pruned_groups": k,
                         "cholesky_solve_s_median": statistics.median(t_base),
                         "lapack_cholesky_solve_s_median": statistics.median(t_lapack),
                         "osscar_s_median": statistics.median(t_os),
                         "ratio_of_medians": statistics.median(t_os) / statistics.median(t_base),
                         "ratio_to_lapack": statistics.median(t_os) / statistics.median(t_lapack),
                         "ratio_median": statistics.median(ratios), "objective": sol.objective,
                         "stats": {k_: v for k_, v in sol.stats.items() if isinstance(v, (int, float, str))}})
            log.info("speed %s", rows[-1])
    return {"repeats": repeats, "rows": rows}


# ---- (c) against recomputing f from scratch -----------------------------------------------------
def part_scratch(d1: int, samples: int) -> dict:
    pb = correlated_problem(d1, d1 // 4, 1, seed=7)
    k = d1 // 2
    t_os = timed(lambda: solve_layer(pb.H, pb.G, 1, k, dense_weight=pb.dense_weight))
    sol = solve_layer(pb.H, pb.G, 1, k, dense_weight=pb.dense_weight)

    def from_scratch(kept_rows: torch.Tensor) -> float:  # f(S) the straightforward way
        H_KK = pb.H[kept_rows][:, kept_rows]
        W = torch.cholesky_solve(pb.G[kept_rows], torch.linalg.cholesky(H_KK))
        return float(-0.5 * (pb.G[kept_rows] * W).sum())

    per_size = {}
    for frac in (1.0, 0.75, 0.5):
        m = int(d1 * frac)
        per_size[m] = statistics.median(timed(lambda m=m: from_scratch(torch.arange(m - 1))) for _ in range(samples))
    # evaluations the same schedule needs: every kept group at every greedy step, then every
    # (candidate, kept) pair of every swap round
    sizes, times = zip(*sorted(per_size.items()), strict=True)
    coef = np.polyfit(np.array(sizes, float), np.array(times), 2)
    remaining, kept, evals = k, d1, 0.0
    step_fraction = 0.2
    while remaining > 0:
        t = min(remaining, max(1, math.ceil(step_fraction * remaining)))
        evals += kept * max(np.polyval(coef, kept), 0)
        kept -= t
        remaining -= t
    rounds = int(sol.stats.get("swap_rounds", 0)) + 1
    evals += rounds * 8 * kept * max(np.polyval(coef, kept), 0)
    return {"d1": d1, "osscar_s": t_os, "from_scratch_candidate_s": per_size,
            "from_scratch_extrapolated_s": evals, "gain": evals / t_os}


# ---- (d) a search with much to swap --------------------------------------------------------------
def issue_problem(d1: int, rows: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(H, G, W_hat) of the fast-solver issue: weakly correlated features, d2 = d1 / 4."""
    gen = torch.Generator().manual_seed(seed)
    eye = torch.eye(d1, dtype=torch.float64)
    A = torch.randn(rows, d1, generator=gen, dtype=torch.float64) @ (
        eye + 0.05 * torch.randn(d1, d1, generator=gen, dtype=torch.float64))
    H = A.T @ A
    W_hat = torch.randn(d1, d1 // 4, generator=gen, dtype=torch.float64)
    return H, H @ W_hat, W_hat


class CountedSolver(OsscarSolver):
    """OsscarSolver whose swap rounds run under an OpCounter: (ops, syncs, exchanges) per round."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rounds: list[tuple[int, int, int]] = []

    def swap_round(self, state, pairs):
        with OpCounter() as c:
            out = super().swap_round(state, pairs)
        self.rounds.append((c.ops, c.syncs, out[1]))
        return out

    def double_swap_round(self, state):
        with OpCounter() as c:
            out = super().double_swap_round(state)
        self.rounds.append((c.ops, c.syncs, out[1]))
        return out


def part_search(sizes: list[int], group_sizes: list[int], rows_4096: int, repeats: int) -> dict:
    rows = []
    for d1 in sizes:
        H, G, W_hat = issue_problem(d1, rows_4096 if d1 == 4096 else int(1.5 * d1))
        for g in group_sizes:
            k = d1 // g // 2
            cholesky_solve(H, G)  # warm-up
            t_base, t_lapack, t_os, sols = [], [], [], []
            for _ in range(repeats):  # interleaved, so both see the same machine load (a shared, noisy VM)
                t_base.append(timed(lambda H=H, G=G: cholesky_solve(H, G)))
                t_lapack.append(timed(lambda H=H, G=G: lapack_cholesky_solve(H, G)))
                start = time.perf_counter()
                sols.append(solve_layer(H, G, g, k, dense_weight=W_hat))
                t_os.append(time.perf_counter() - start)
            sol = sols[0]
            assert all(s.pruned == sol.pruned and s.objective == sol.objective for s in sols), "not deterministic"
            mp = solve_layer(H, G, g, k, "mp+", dense_weight=W_hat)
            t_b, t_l, t_o = (statistics.median(t) for t in (t_base, t_lapack, t_os))
            phases = {name: statistics.median(float(s.stats.get(name, 0.0)) for s in sols)
                      for name in ("factorise_s", "greedy_s", "swap_setup_s", "swap_s", "guard_s")}
            row = {"d1": d1, "group_size": g, "repeats": repeats, "cholesky_solve_s": t_b,
                   "lapack_cholesky_solve_s": t_l, "osscar_s": t_o, "ratio": t_o / t_b, "ratio_to_lapack": t_o / t_l,
                   "osscar_s_all": t_os, "phases_median_s": phases,
                   "osscar_f": sol.objective, "mp_plus_f": mp.objective,
                   "stats": {k_: v for k_, v in sol.stats.items() if isinstance(v, (int, float, str))}}
            if d1 == sizes[0]:
                counted = CountedSolver(LayerProblem.validate(H, G, g, k, W_hat), OsscarConfig())
                counted.search()
                ops, syncs, swaps = zip(*counted.rounds, strict=True) if counted.rounds else ((0,), (0,), (0,))
                row["per_round"] = {"rounds": len(counted.rounds), "ops_median": statistics.median(ops),
                                    "ops_max": max(ops), "syncs_max": max(syncs),
                                    "syncs_median": statistics.median(syncs),
                                    "exchanges_median": statistics.median(swaps), "exchanges_max": max(swaps)}
            log.info("search %s", row)
            rows.append(row)
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="small,real,speed,scratch,search")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("solver_results.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_grad_enabled(False)
    parts = args.parts.split(",")
    result: dict = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                               f"{torch.get_num_threads()} threads, torch {torch.__version__}",
                    "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    if "small" in parts:
        result["small"] = part_small(30 if args.quick else 200)
        log.info("small %s", result["small"])
    if "real" in parts:
        result["real"] = part_real(args.quick)
        log.info("real %s", {k: v for k, v in result["real"].items() if k != "layers"})
    if "speed" in parts:
        sizes = [512, 1024] if args.quick else [1024, 4096, 8192]
        result["speed"] = part_speed(sizes, [1, 64], 1 if args.quick else 3)
    if "scratch" in parts:
        result["scratch"] = part_scratch(1024 if args.quick else 4096, 2 if args.quick else 3)
        log.info("scratch %s", result["scratch"])
    if "search" in parts:
        result["search"] = part_search([1024] if args.quick else [4096, 8192], [1, 64],
                                       rows_4096=6000, repeats=1 if args.quick else 3)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "real"}, indent=1, default=str))
    if "real" in result and "layers" in result["real"]:
        print(json.dumps({k: v for k, v in result["real"].items() if k != "layers"}, indent=1))


if __name__ == "__main__":
    main()
