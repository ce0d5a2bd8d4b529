"""GPU measurements of the fast-solver issue -> rows for bench/RESULTS.md. One command on a GPU machine:

    python bench/gpu.py                                   # solver table, ORT CUDA, 1.3B pipeline
    PYTHONPATH=/path/to/mazumder-lab/OSSCAR python bench/gpu.py   # the official solver alongside
    python bench/gpu.py --parts solver --sizes 4096       # one part
    python bench/gpu.py --device cpu --quick              # a smoke run of every part on the CPU

GPU time is scarce, so the parts run in this order and each prints its rows as soon as it has them:
  solver    `solve_layer(method="osscar")`, fp64, d2 = d1/4, 50 % pruned, on the issue's problem
            (A = randn(1.5 d1, d1) (I + 0.05 randn(d1, d1)), H = A^T A, G = H W_hat, seed 7), against one fp64
            Cholesky solve of H^-1 G and, when the official `prune_algo.py` is importable, its
            `OSSCAR_fastprune` with 64 groups per step (never copied here: put its repository on PYTHONPATH)
  ort       ONNX Runtime with the CUDA provider: a decoder at 1 x 1024 and a BERT-base-shaped encoder at
            32 x 128, dense against a half-width FFN copy, timed with I/O binding and with host copies
  pipeline  a 1.3B-parameter OPT-shaped decoder (random init: hidden 2048, 24 layers, 32 heads, FFN 8192,
            vocab 50272), 128 x 2048 random token ids, `StreamedCheckpoint` + `prune_blocks` at ratio 0.5,
            block reconstruction off; osscar and mp+ each in a fresh process with a 10-minute limit
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
log = logging.getLogger("bench.gpu")


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))  # the card asked for, not the current one (0)


def _timed(fn: Callable[[], object], device: str, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` runs after one warm-up, synchronised; and the last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def part_solver(device: str, sizes: list[int], repeats: int) -> list[dict]:
    import torch

    from compressor import solve_layer

    try:
        from prune_algo import OSSCAR_fastprune  # the official code, from PYTHONPATH
    except ImportError:
        OSSCAR_fastprune = None
        log.info("official prune_algo.py not importable: its column stays empty")
    rows = []
    torch.set_grad_enabled(False)
    for d1 in sizes:
        gen = torch.Generator(device=device).manual_seed(7)
        eye = torch.eye(d1, dtype=torch.float64, device=device)
        A = torch.randn(int(1.5 * d1), d1, generator=gen, dtype=torch.float64, device=device) @ (
            eye + 0.05 * torch.randn(d1, d1, generator=gen, dtype=torch.float64, device=device))
        H = A.T @ A
        del A, eye
        W_hat = torch.randn(d1, d1 // 4, generator=gen, dtype=torch.float64, device=device)
        G = H @ W_hat
        for g in (1, 64):
            p = d1 // g
            t_chol, _ = _timed(lambda H=H, G=G: torch.cholesky_solve(G, torch.linalg.cholesky(H)), device, repeats)
            t_os, sol = _timed(lambda H=H, G=G, W=W_hat, g=g, p=p: solve_layer(H, G, g, p // 2, dense_weight=W),
                               device, repeats)
            card = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
            row = {"device": card, "d1": d1,
                   "group": g, "cholesky_s": t_chol, "osscar_s": t_os, "osscar_f": sol.objective,
                   "osscar_over_cholesky": t_os / t_chol,
                   "phases": {k: v for k, v in sol.stats.items() if k.endswith("_s") or k in ("swap_rounds", "swaps")}}
            if OSSCAR_fastprune is not None:
                def official(H=H, G=G, W=W_hat, p=p):  # keeps p - p // 2 groups, 64 pruned per step
                    return OSSCAR_fastprune(W.clone(), H, G, p, p - p // 2, 64)

                t_off, (_, f_off) = _timed(official, device, repeats)
                row.update(official_s=t_off, official_f=float(f_off), official_over_osscar=t_off / t_os)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def part_ort(device: str, quick: bool) -> list[dict]:
    """Dense vs a uniformly half-pruned copy (sliced weights) of two shapes, exported and timed with and
    without I/O binding."""
    import torch
    import transformers

    from compressor.transformer.pipeline import resize_transformer
    from exporters.onnx import export_hf_onnx
    from exporters.runtime import measure_latency

    provider = "cuda" if device.startswith("cuda") else "cpu"
    small = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    decoder = transformers.OPTConfig(**(small if quick else {"hidden_size": 1024, "num_hidden_layers": 12,
                                                             "num_attention_heads": 16}),
                                     ffn_dim=512 if quick else 4096, vocab_size=1000 if quick else 50272,
                                     max_position_embeddings=2048)
    encoder = transformers.BertConfig(**(small if quick else {"hidden_size": 768, "num_hidden_layers": 12,
                                                              "num_attention_heads": 12}),
                                      intermediate_size=512 if quick else 3072)
    shapes = [("decoder 1x1024", decoder, 1, 64 if quick else 1024, "logits"),
              ("encoder 32x128", encoder, 32, 128, "last_hidden_state")]
    rows = []
    for name, config, batch, length, output in shapes:
        torch.manual_seed(0)
        model = (transformers.OPTForCausalLM(config) if output == "logits" else transformers.BertModel(config)).eval()
        half = resize_transformer(model, 0.5)
        ids = torch.randint(3, 1000, (batch, length))
        example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with tempfile.TemporaryDirectory() as tmp:
            export_hf_onnx(model, example, tmp + "/dense.onnx", output_name=output)
            export_hf_onnx(half, example, tmp + "/half.onnx", output_name=output)
            feed = {k: v.numpy() for k, v in example.items()}
            lat = measure_latency(tmp + "/dense.onnx", tmp + "/half.onnx", feed, provider=provider, io_binding=True)
        row = {"shape": name, "provider": provider, "device": lat.device,
               "bound_ms": [lat.baseline_ms, lat.compressed_ms], "bound_speedup": lat.speedup,
               "host_ms": [lat.host_baseline_ms, lat.host_compressed_ms], "host_speedup": lat.host_speedup}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _pipeline_worker(method: str, device: str, quick: bool, workdir: str) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from compressor.transformer.offload import StreamedCheckpoint
    from compressor.transformer.pipeline import prune_blocks

    source = Path(workdir) / ("opt-1.3b-random" if not quick else "opt-tiny-random")
    if not (source / "config.json").is_file():
        shape = (dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, ffn_dim=512, vocab_size=1000)
                 if quick else dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, ffn_dim=8192,
                                    vocab_size=50272))
        config = transformers.OPTConfig(**shape, max_position_embeddings=2048)
        torch.manual_seed(0)
        transformers.OPTForCausalLM(config).save_pretrained(source, max_shard_size="1GB")
    sequences, length = (128, 2048) if not quick else (8, 64)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (sequences, length), generator=gen)
    batches = [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in ids.split(8)]
    out = Path(workdir) / f"pruned-{method}"
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(torch.device(device))
    start = time.perf_counter()
    checkpoint = StreamedCheckpoint(str(source), str(out))
    prune_blocks(checkpoint, batches, 0.5, method=method, device=device)
    checkpoint.finish()
    _sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(torch.device(device)) / 2**30 if device.startswith("cuda") else None
    return {"method": method, "seconds": seconds, "peak_gpu_gib": peak}


def part_pipeline(device: str, quick: bool, workdir: str, limit_s: float) -> list[dict]:
    rows = []
    for method in ("osscar", "mp+"):
        pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"))  # each method in a fresh process
        try:
            row = pool.submit(_pipeline_worker, method, device, quick, workdir).result(timeout=limit_s)
        except FutureTimeout:
            row = {"method": method, "seconds": None, "error": f"over the {limit_s:.0f} s limit"}
            for proc in pool._processes.values():  # the limit is the point: stop it
                proc.kill()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if all(r.get("seconds") for r in rows):
        print(json.dumps({"osscar_over_mp_plus": rows[0]["seconds"] / rows[1]["seconds"]}), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="solver,ort,pipeline")
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument("--sizes", default="4096,8192,16384", help="solver part: d1 values")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke run")
    parser.add_argument("--workdir", default="/tmp/osscar-gpu-bench")
    parser.add_argument("--limit", type=float, default=600.0, help="pipeline part: seconds per method")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sizes = [int(s) for s in args.sizes.split(",")] if not args.quick else [256]
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "device": device, "command": " ".join(sys.argv)}), flush=True)
    for part in args.parts.split(","):
        if part == "solver":
            part_solver(device, sizes, args.repeats if not args.quick else 1)
        elif part == "ort":
            part_ort(device, args.quick)
        elif part == "pipeline":
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
            part_pipeline(device, args.quick, args.workdir, args.limit)
        else:
            parser.error(f"unknown part {part!r}")


if __name__ == "__main__":
    main()
