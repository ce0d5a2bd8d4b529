"""Gathered attention (KV heads read through an index) against HF's `repeat_kv` attention, in ONNX Runtime.

    python bench/gqa_attention.py                        # SmolLM2-135M shape, random init
    python bench/gqa_attention.py --layers 4 --threads 2

Pruning single query heads under grouped-query attention makes the attention read K/V through an index
(`compressor/transformer/attention.py`). This measures what that costs where the model is served: the
same dense weights exported twice with the dynamo exporter, once with transformers' sdpa attention
(`repeat_kv`) and once with the gathered attention (identity map), then both run alternating in one ONNX
Runtime session pair (CPU EP) per input shape. Random weights: only latency is measured (the outputs
are checked to agree first).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((1, 512), (8, 128), (1, 64))  # (batch, sequence): the causal job's default shape first


def smollm2_config(layers: int):
    import transformers

    return transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                    num_key_value_heads=3, head_dim=64, num_hidden_layers=layers,
                                    vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
                                    rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("gqa_attention.json"))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import transformers

    from compressor.transformer.attention import use_gathered_attention
    from exporters.onnx import export_hf_onnx
    from exporters.runtime import measure_latency, run_outputs

    torch.manual_seed(0)
    config = smollm2_config(args.layers)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).eval()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ids = torch.randint(3, config.vocab_size, (2, 16))
        example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        repeat_kv, gathered = Path(tmp) / "repeat_kv.onnx", Path(tmp) / "gathered.onnx"
        export_hf_onnx(model, example, repeat_kv, output_name="logits")
        use_gathered_attention(model)
        export_hf_onnx(model, example, gathered, output_name="logits")
        for batch, seq in SHAPES:
            feed_ids = np.random.default_rng(0).integers(3, config.vocab_size, size=(batch, seq), dtype=np.int64)
            feed = {"input_ids": feed_ids, "attention_mask": np.ones_like(feed_ids)}
            a, b = (run_outputs(p, [feed], threads=args.threads)[0][0] for p in (repeat_kv, gathered))
            error = float(np.abs(a - b).max() / (np.abs(a).max() + 1e-12))
            assert error < 1e-4, f"the two exports disagree at {batch}x{seq}: {error:.2e}"
            latency = measure_latency(repeat_kv, gathered, feed, threads=args.threads, repeats=args.repeats)
            rows.append({"batch": batch, "sequence": seq, "repeat_kv_ms": latency.baseline_ms,
                         "gathered_ms": latency.compressed_ms, "repeat_kv_p90_ms": latency.baseline_p90_ms,
                         "gathered_p90_ms": latency.compressed_p90_ms, "gathered_speed": latency.speedup,
                         "max_rel_diff": error})
            print(f"| {batch}x{seq} | {latency.baseline_ms:.1f} | {latency.compressed_ms:.1f} | "
                  f"{latency.speedup:.3f} |", flush=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                                    "layers": args.layers, "threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
