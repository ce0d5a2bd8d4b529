"""Peak memory of transformer pruning against model size -> bench/RESULTS.md.

    python bench/memory.py                        # ~3.3 GB fp32 random-init Llama-style decoder
    python bench/memory.py --layers 4 --hidden 1024 --intermediate 2816   # a quick run
    python bench/memory.py --intermediate 8192 --vocab 128256 --heads 32 --kv-heads 8 --tie \
        --dtype bfloat16 --modes streamed      # Llama-3.2-1B's shape, bf16 safetensors
    python bench/memory.py ... --device cuda --refine-steps 50   # solved (and fitted) on a GPU: its peak memory too
    python bench/memory.py --hidden 1024 --layers 8 --experts 32 --intermediate 512 --top-k 4 --dtype bfloat16
                                                  # a Qwen3-MoE-shaped model (--intermediate: each expert's width)

Builds (once, cached in --workdir) a random-init decoder saved as safetensors shards, then prunes it
in two fresh processes, one after the other: `streamed` (StreamedCheckpoint: blocks read one at a
time from the shards and written back pruned) and `in-memory` (the whole model loaded, a pruned copy
made, saved). Reports each process's peak RSS (ru_maxrss) and wall time. Calibration is random token
ids (memory, not quality, is measured here). `--methods osscar,mp+` runs each mode with each layer solver
(block reconstruction off): the time osscar adds over mp+ on the same pipeline. Each row also has the time
of each stage (opening the checkpoint or loading the model, the blocks one by one, writing the result).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.memory")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _build(path: str, hidden: int, layers: int, intermediate: int, vocab: int, heads: int, kv_heads: int,
           tie: bool, dtype: str, experts: int = 0, top_k: int = 0) -> float:
    import torch
    import transformers

    sizes = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=1024,
                 tie_word_embeddings=tie)
    if experts:  # Qwen3-MoE's layout; save_pretrained stores each expert's projections apart, as its checkpoints do
        config = transformers.Qwen3MoeConfig(**sizes, head_dim=hidden // heads, num_experts=experts,
                                             num_experts_per_tok=min(top_k, experts),
                                             moe_intermediate_size=intermediate)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**sizes), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval().to(getattr(torch, dtype))
    model.save_pretrained(path, max_shard_size="1GB")
    return sum(p.numel() for p in model.parameters()) / 1e6


def _calibration(vocab: int, sequences: int, length: int) -> list:
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (sequences, length), generator=gen)
    return [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in ids.split(4)]


def _prune(mode: str, source: str, out: str, ratio: float, sequences: int, length: int,
           method: str = "osscar", device: str | None = None, refine_steps: int = 0) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from compressor.refine import RefineConfig
    from compressor.transformer.models import load_transformer
    from compressor.transformer.offload import StreamedCheckpoint
    from compressor.transformer.pipeline import prune_blocks, prune_transformer
    from compressor.transformer.surgery import save_pruned

    refine = RefineConfig(steps=refine_steps) if refine_steps else None
    cuda = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    start = time.perf_counter()
    marks: list[tuple[str, float]] = []  # (stage, time it ended)

    def mark(stage: str) -> None:
        marks.append((stage, time.perf_counter()))

    if mode == "streamed":
        checkpoint = StreamedCheckpoint(source, out)
        mark("open")
        load, store = checkpoint.load, checkpoint.store

        def timed_load(index: int):
            mark("capture" if index == 0 else f"block {index - 1} (between)")
            return load(index)

        def timed_store(index: int) -> None:
            store(index)
            mark(f"block {index}")

        checkpoint.load, checkpoint.store = timed_load, timed_store
        batches = _calibration(checkpoint.model.config.vocab_size, sequences, length)
        prune_blocks(checkpoint, batches, ratio, method=method, device=device, refine=refine)
        mark("blocks")
        checkpoint.finish()
        mark("finish")
    else:
        model = load_transformer(source).model
        mark("load")
        batches = _calibration(model.config.vocab_size, sequences, length)
        pruned, _ = prune_transformer(model, batches, ratio, method=method, device=device, refine=refine)
        mark("prune")
        save_pruned(pruned, out)
        mark("save")
    stages, previous = {}, start
    for stage, end in marks:
        stages[stage] = round(end - previous, 2)
        previous = end
    blocks = [v for k, v in stages.items() if k.startswith("block ") and "between" not in k]
    return {"mode": mode, "method": method, "refine_steps": refine_steps, "seconds": time.perf_counter() - start,
            "peak_rss_mb": _peak_rss_mb(),
            "peak_device_mb": torch.cuda.max_memory_allocated(torch.device(device or "cuda")) / 2**20 if cuda else None,
            "device": torch.cuda.get_device_name(torch.device(device or "cuda")) if cuda else "cpu", "stages": stages,
            "block_seconds_median": sorted(blocks)[len(blocks) // 2] if blocks else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=5504)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=0, help="query heads (default hidden / 128)")
    parser.add_argument("--kv-heads", type=int, default=0, help="KV heads (default hidden / 256)")
    parser.add_argument("--tie", action="store_true", help="tie the LM head to the embeddings (Llama 3.2)")
    parser.add_argument("--experts", type=int, default=0, help="a Qwen3-MoE-shaped model of this many experts a "
                        "layer, each --intermediate wide (0: a dense Llama)")
    parser.add_argument("--top-k", type=int, default=4, help="experts a token visits (with --experts)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the checkpoint's dtype (pruning upcasts each block on the device)")
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--modes", default="streamed,in-memory")
    parser.add_argument("--methods", default="osscar", help="layer solvers, comma-separated (osscar, mp+)")
    parser.add_argument("--device", default=None, help="where blocks are solved (default: cuda when available)")
    parser.add_argument("--refine-steps", type=int, default=0, help="block reconstruction's Adam steps (0: off)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/osscar-memory-bench"))
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("memory_results.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    heads, kv_heads = args.heads or args.hidden // 128, args.kv_heads or args.hidden // 256
    shape = f"h{args.hidden}-l{args.layers}-i{args.intermediate}-v{args.vocab}"
    if (heads, kv_heads, args.tie, args.dtype) != (args.hidden // 128, args.hidden // 256, False, "float32"):
        shape += f"-q{heads}-kv{kv_heads}{'-tied' if args.tie else ''}-{args.dtype}"
    if args.experts:
        shape += f"-moe{args.experts}x{args.top_k}"
    source = args.workdir / shape
    spawn = get_context("spawn")
    if not (source / "config.json").is_file():
        log.info("building %s", source)
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:
            pool.submit(_build, str(source), args.hidden, args.layers, args.intermediate, args.vocab, heads, kv_heads,
                        args.tie, args.dtype, args.experts, args.top_k).result()
    size_mb = sum(f.stat().st_size for f in source.glob("*.safetensors")) / 2**20
    rows = []
    for mode, method in [(m, k) for m in args.modes.split(",") for k in args.methods.split(",")]:
        out = args.workdir / f"{shape}-pruned-{mode}"
        shutil.rmtree(out, ignore_errors=True)
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:  # a fresh process: its own peak RSS
            row = pool.submit(_prune, mode, str(source), str(out), args.ratio, args.sequences, args.length,
                              method, args.device, args.refine_steps).result()
        row["pruned_mb"] = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20
        rows.append(row)
        log.info("%s %s: peak RSS %.0f MB for a %.0f MB checkpoint (%.2fx), %.0f s", mode, method,
                 row["peak_rss_mb"], size_mb, row["peak_rss_mb"] / size_mb, row["seconds"])
        shutil.rmtree(out, ignore_errors=True)
    result = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "checkpoint_mb": size_mb,
              "shape": shape, "ratio": args.ratio, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1))
    for row in rows:
        print(f"| {shape} | {size_mb:.0f} | {row['mode']} ({row['method']}) | {row['peak_rss_mb']:.0f} | "
              f"{row['peak_rss_mb'] / size_mb:.2f} | {row['seconds']:.0f} |")


if __name__ == "__main__":
    main()
