"""ONNX Runtime's memory with a decoder's graph whole and in pieces (`exporters/pieces.py`) -> bench/RESULTS.md.

    python bench/pieces.py --model ~/.cache/osscar-bench/smollm2-135m --budget-mb 64
    python bench/memory.py --intermediate 8192 --vocab 128256 --heads 32 --kv-heads 8 --tie --dtype bfloat16 \\
        --modes streamed --workdir <dir>      # builds the Llama-3.2-1B-shaped bf16 checkpoint (then stop it)
    python bench/pieces.py --model <dir>/model --budget-mb 512

Exports the Hugging Face decoder `--model` to a float32 ONNX graph as a job does (a half-precision model through
`exported_in`, no float32 copy), then, each in a fresh process, one after the other: the summed next-token NLL of
`--windows` random windows of `--length` tokens with the graph whole and in pieces of at most `--budget-mb` of
weights, and the latency of the graph against itself (1 x `--length` tokens) whole (paired: both sessions in one
process) and in pieces (piece k of both side by side, paired). Each row: the ONNX Runtime subprocess's peak RSS,
the wall time, and the answer (NLL, or the speedup of a graph against itself, 1.00 when right). Random ids: memory
and agreement are measured here, not quality.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _export(model_dir: str, path: Path, length: int) -> float:
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from exporters.onnx import export_hf_onnx, exported_in

    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    ids = torch.randint(3, 100, (1, min(length, 16)))
    with exported_in(model, "fp32") as view:
        export_hf_onnx(view, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, path, output_name="logits")
    return time.perf_counter() - start


def _one(args: argparse.Namespace) -> dict:
    """One measurement in this (fresh) process; the ONNX Runtime subprocess's peak RSS from RUSAGE_CHILDREN."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from exporters.runtime import measure_latency, run_outputs

    budget = None if args.mode == "whole" else int(args.budget_mb * 2**20)
    vocab = int(args.vocab)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    if args.what == "nll":
        ids = rng.integers(3, vocab, (args.windows, args.length))
        batches = [{"input_ids": b, "attention_mask": np.ones_like(b)} for b in np.split(ids, args.windows // 4)]
        pairs = run_outputs(args.onnx, batches, reduce="nll", piece_bytes=budget)
        answer = sum(n for n, _ in pairs) / sum(t for _, t in pairs)
        extra = {}
    else:
        ids = rng.integers(3, vocab, (1, args.length))
        latency = measure_latency(args.onnx, args.onnx, {"input_ids": ids, "attention_mask": np.ones_like(ids)},
                                  piece_bytes=budget, together=True if budget is None else None)
        answer = latency.speedup
        extra = {"ms": round(latency.baseline_ms, 1), "samples": latency.repeats, "pieces": latency.pieces}
    return {"what": args.what, "mode": args.mode, "answer": answer, "seconds": round(time.perf_counter() - start, 1),
            "onnx_runtime_peak_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
            **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face decoder directory to export (or --onnx)")
    parser.add_argument("--onnx", help="an exported graph (skips the export)")
    parser.add_argument("--workdir", default=str(Path.home() / ".cache/osscar-bench/pieces"))
    parser.add_argument("--budget-mb", type=float, default=512.0, help="a piece's weights, MiB")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--skip", default="", help="comma-separated rows to leave out, e.g. latency-whole")
    parser.add_argument("--what", choices=["nll", "latency"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["whole", "pieces"], help=argparse.SUPPRESS)
    parser.add_argument("--vocab", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.what:  # a child: one measurement
        print(json.dumps(_one(args)))
        return
    path = Path(args.onnx) if args.onnx else Path(args.workdir) / "model.onnx"
    if not args.onnx:
        path.parent.mkdir(parents=True, exist_ok=True)
        print(json.dumps({"exported": str(path), "seconds": round(_export(args.model, path, args.length), 1)}),
              flush=True)
    import onnx

    vocab = next(d.dim_value for d in onnx.load(str(path), load_external_data=False).graph.output[0].type
                 .tensor_type.shape.dim if d.dim_value)
    for what in ("nll", "latency"):
        for mode in ("whole", "pieces"):
            if f"{what}-{mode}" in args.skip.split(","):
                continue
            child = subprocess.run([sys.executable, __file__, "--onnx", str(path), "--what", what, "--mode", mode,
                                    "--vocab", str(vocab), "--budget-mb", str(args.budget_mb), "--windows",
                                    str(args.windows), "--length", str(args.length)],
                                   capture_output=True, text=True, check=False)
            print(child.stdout.strip().splitlines()[-1] if child.returncode == 0 else
                  json.dumps({"what": what, "mode": mode, "failed": child.stderr.strip()[-500:]}), flush=True)


if __name__ == "__main__":
    main()
