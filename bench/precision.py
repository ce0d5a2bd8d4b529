"""Precision of the layer statistics: H and G accumulated in float64 (as shipped) against float32 -> bench/RESULTS.md.

    python bench/precision.py                     # all-MiniLM-L6-v2, 256 WikiText windows of 16-128 tokens

For the attention-output and FFN-output projections of a few layers of the embedded all-MiniLM-L6-v2 (a
real model, from its PyPI package), calibrated on WikiText-2 from ../shared/data: the relative difference
of H = X^T X and G = X^T X W_hat summed batch by batch in float32 instead of float64, and what the solver
makes of each (osscar at half the groups): the share of the float64 support that the float32 one keeps,
and both weights' reconstruction error on the float64 problem, relative to the layer's output energy.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATA = ROOT.parent / "shared" / "data" / "text" / "wikitext-2-raw-test.txt"
log = logging.getLogger("bench.precision")


def _layer_rows(model: torch.nn.Module, module: torch.nn.Module, batches: list[dict]) -> list[torch.Tensor]:
    """The module's float32 input rows over the counted tokens, batch by batch."""
    rows: list[torch.Tensor] = []
    handle = module.register_forward_pre_hook(lambda _m, args: rows.append(args[0].reshape(-1, args[0].shape[-1])))
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch)
                rows[-1] = rows[-1][batch["attention_mask"].reshape(-1).bool()]
    finally:
        handle.remove()
    return rows


def compare(rows: list[torch.Tensor], W_hat: torch.Tensor, group_size: int) -> dict:
    from compressor import solve_layer

    H64 = sum(x.double().T @ x.double() for x in rows)
    H32 = sum(x.T @ x for x in rows).double()
    Y = [x.double() @ W_hat for x in rows]
    G64 = sum(x.double().T @ y for x, y in zip(rows, Y, strict=True))
    G32 = sum(x.T @ (x @ W_hat.float()) for x in rows).double()
    energy = 0.5 * sum(float(y.square().sum()) for y in Y)
    k = H64.shape[0] // group_size // 2
    exact = solve_layer(H64, G64, group_size, k, dense_weight=W_hat)
    rounded = solve_layer(H32, G32, group_size, k, dense_weight=W_hat)

    def error(weight: torch.Tensor) -> float:  # on the float64 problem
        W = weight.double()
        return (0.5 * float((W * (H64 @ W)).sum()) - float((G64 * W).sum()) + energy) / energy

    return {"d1": H64.shape[0], "tokens": sum(x.shape[0] for x in rows),
            "H_difference": float((H32 - H64).norm() / H64.norm()),
            "G_difference": float((G32 - G64).norm() / G64.norm()),
            "error_float64": error(exact.weight), "error_float32": error(rounded.weight),
            "same_support": len(set(exact.pruned) & set(rounded.pruned)) / max(k, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="1,4", help="encoder layers, comma-separated")
    parser.add_argument("--sequences", type=int, default=256)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not DATA.is_file():
        raise SystemExit(f"needs {DATA} (../shared/data)")
    import transformers

    from compressor.calibration import load_text
    from service.embedded import default_model_path

    path = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    batches = load_text(DATA, tokenizer=tokenizer, sequences=args.sequences, length=128, min_length=16)
    heads = model.config.num_attention_heads
    print("| layer | projection | d1 | tokens | H float32 vs float64 | G | relative error, float64 statistics | "
          "float32 | same support |")
    print("|---|---|---|---|---|---|---|---|---|")
    for index in (int(i) for i in args.layers.split(",")):
        layer = model.encoder.layer[index]
        for name, module, group in (("attention output", layer.attention.output.dense,
                                     model.config.hidden_size // heads),
                                    ("FFN output", layer.output.dense, 1)):
            row = compare(_layer_rows(model, module, batches), module.weight.detach().T.double(), group)
            print(f"| {index} | {name} | {row['d1']} | {row['tokens']} | {row['H_difference']:.1e} | "
                  f"{row['G_difference']:.1e} | {row['error_float64']:.6f} | {row['error_float32']:.6f} | "
                  f"{row['same_support']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
