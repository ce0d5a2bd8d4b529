"""A Mixture-of-Experts decoder at a size where timing means something, through `osscar compress` -> bench/RESULTS.md.

    .venv/bin/python bench/moe.py                      # Qwen3-MoE-shaped, ~0.5 B parameters, bf16 safetensors
    .venv/bin/python bench/moe.py --layers 2 --experts 8 --modes uniform     # a quick run

No Mixture-of-Experts checkpoint ships as a Python package, so the model is random-init (`--family`: qwen3_moe,
qwen2_moe (a shared expert beside the routed ones, `--shared-width`), glm4_moe (a dense first layer, experts picked
by grouped sigmoid routing, an ungated shared expert), phimoe (two experts a token by the sparse mixer:
`--top-k 2`), gpt_oss (attention sinks, clamped SwiGLU experts with biases) or mixtral; structure, export, latency,
time and memory are measured, not quality). Each mode runs the CLI in a fresh process: its row has the job's status, the
measured speedup of the returned ONNX against the dense one (ONNX Runtime, each MoE layer one com.microsoft.MoE node),
the parameters, the parity of the export, the seconds of each stage (report.json `stages`), the expert widths kept,
the layers removed, and the process's peak RSS (the larger of its own and its largest subprocess's: ONNX Runtime's);
the job's log goes to `<out>.log` as it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODES = {"uniform": ["--uniform-ratio", "0.25"], "target": ["--target-speedup", "1.25"]}


def _build(path: Path, args: argparse.Namespace) -> int:
    """The random-init model saved as safetensors in `args.dtype`; its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    shared = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, num_experts_per_tok=args.top_k,
                  max_position_embeddings=4096)
    if args.family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_experts=args.experts, moe_intermediate_size=args.expert_width,
                                             head_dim=args.hidden // args.heads, norm_topk_prob=True, **shared)
        model = transformers.Qwen3MoeForCausalLM(config)
    elif args.family == "gpt_oss":  # gpt-oss's layout: interleaved gate / up with biases, a clamped SwiGLU, sinks
        config = transformers.GptOssConfig(num_local_experts=args.experts, intermediate_size=args.expert_width,
                                           head_dim=args.hidden // args.heads, sliding_window=128,
                                           layer_types=["sliding_attention", "full_attention"] * (args.layers // 2)
                                           + ["sliding_attention"] * (args.layers % 2), **shared)
        model = transformers.GptOssForCausalLM(config)
    elif args.family == "phimoe":  # Phi-3.5-MoE's layout: two experts a token by the sparse mixer
        config = transformers.PhimoeConfig(num_local_experts=args.experts, intermediate_size=args.expert_width,
                                           router_jitter_noise=0.01, attention_bias=True, **shared)
        model = transformers.PhimoeForCausalLM(config)
    elif args.family == "glm4_moe":  # GLM-4.5's layout: a dense first layer, grouped sigmoid routing, a shared expert
        config = transformers.Glm4MoeConfig(n_routed_experts=args.experts, moe_intermediate_size=args.expert_width,
                                            n_shared_experts=max(1, args.shared_width // args.expert_width),
                                            intermediate_size=args.shared_width, first_k_dense_replace=1,
                                            n_group=args.groups, topk_group=max(1, args.groups // 2),
                                            head_dim=args.hidden // args.heads, use_qk_norm=True, **shared)
        model = transformers.Glm4MoeForCausalLM(config)
        with torch.no_grad():  # its initialisation zeroes the correction bias, which a trained router has
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.01)
    elif args.family == "qwen2_moe":  # Qwen1.5-MoE's layout: a shared expert beside the routed ones
        config = transformers.Qwen2MoeConfig(num_experts=args.experts, moe_intermediate_size=args.expert_width,
                                             shared_expert_intermediate_size=args.shared_width,
                                             intermediate_size=args.shared_width, **shared)
        model = transformers.Qwen2MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(num_local_experts=args.experts, intermediate_size=args.expert_width,
                                            **shared)
        model = transformers.MixtralForCausalLM(config)
    model.to(getattr(torch, args.dtype)).save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024  # Linux: KiB


def _job(model: str, mode: str, calibration: str, out: str, extra: list[str]) -> dict:
    """One CLI job in this (fresh) process: its report's numbers and stage seconds, the peak RSS."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from service.client import cli

    log_path = Path(f"{out}.log")  # beside --out, written as the job goes (a long job can be followed)
    start = time.perf_counter()
    with log_path.open("w") as err, contextlib.redirect_stderr(err):
        logging.basicConfig(format="%(asctime)s %(name)s %(message)s", stream=err, level=logging.INFO)
        code = cli.main(["-v", "compress", model, *MODES[mode], "--calibration", calibration, "--out", out,
                         "--accuracy-budget", "none", *extra])
    seconds = time.perf_counter() - start
    report_path = Path(out) / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    lines = log_path.read_text().strip().splitlines()
    experts = [layer["width_after"] for layer in report.get("layers", []) if layer["name"].endswith("mlp.experts")]
    return {"mode": mode, "exit": code, "status": report.get("status", lines[-1][:200] if lines else ""),
            "speedup": report.get("measured_speedup"),
            "params": [report.get("params_before"), report.get("params_after")],
            "parity_peak": (report.get("artifacts", {}).get("parity") or {}).get("peak_error"),
            "expert_widths": experts, "removed_layers": report.get("removed_layers"),
            "seconds": round(seconds, 1), "stages": report.get("stages"), "peak_rss_mb": round(_peak_rss_mb())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("qwen3_moe", "qwen2_moe", "glm4_moe", "phimoe", "gpt_oss", "mixtral"),
                        default="qwen3_moe")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--shared-width", type=int, default=2048,
                        help="qwen2_moe: the shared expert's neurons; glm4_moe: the dense first layer's (its shared "
                             "expert: the multiple of --expert-width nearest below)")
    parser.add_argument("--groups", type=int, default=4, help="glm4_moe: expert groups (half of them chosen a token)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", default="uniform,target")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/osscar-bench-moe"))
    parser.add_argument("--extra", default="", help="further CLI flags for every job, space-separated")
    args = parser.parse_args()
    shape = (f"{args.family}-h{args.hidden}-l{args.layers}-e{args.experts}x{args.expert_width}-k{args.top_k}-"
             f"v{args.vocab}-{args.dtype}")
    if args.family in ("qwen2_moe", "glm4_moe"):  # the shared expert's (and a dense layer's) width, the groups
        shape += f"-s{args.shared_width}" + (f"-g{args.groups}" if args.family == "glm4_moe" else "")
    model = args.workdir / shape
    if not (model / "config.json").is_file():
        start = time.perf_counter()
        params = _build(model, args)
        print(json.dumps({"built": str(model), "params": params, "seconds": round(time.perf_counter() - start, 1)}),
              flush=True)
    calibration = args.workdir / f"ids-{args.vocab}.npz"
    if not calibration.is_file():
        rng = np.random.default_rng(0)
        np.savez(calibration, ids=rng.integers(3, args.vocab, size=200_000), offsets=[0, 100_000, 200_000])
    for mode in args.modes.split(","):
        out = args.workdir / f"{shape}-{mode}"
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:  # a fresh process: its own peak
            row = pool.submit(_job, str(model), mode, str(calibration), str(out), args.extra.split()).result()
        print(json.dumps({"shape": shape, **row}), flush=True)


if __name__ == "__main__":
    main()
