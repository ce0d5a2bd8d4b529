"""The `osscar` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    from .demo import format_table, run_demo

    print(f"Pruning {args.ratio:.0%} of the heads and FFN neurons of every layer of "
          f"{args.model or 'all-MiniLM-L6-v2 (embedded)'}, layer by layer;\n"
          "relative output error ||X (W_hat - W)||^2 / ||X W_hat||^2 per method (lower is better):\n",
          file=sys.stderr)
    print(format_table(run_demo(args.ratio, args.model)))
    return 0


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from err


def _compress(args: argparse.Namespace) -> int:
    from .compress import CompressRequest, compress

    request = CompressRequest(model=args.model, uniform_ratio=args.uniform_ratio, calibration=args.calibration,
                              out_dir=args.out, method=args.method, samples=args.samples, seed=args.seed,
                              mean=args.mean, std=args.std, device=args.device, batch_size=args.batch_size,
                              sequences=args.sequences, sequence_length=args.sequence_length, stream=args.stream,
                              activation_dtype=args.activation_dtype)
    compress(request, progress=lambda message: print(message, file=sys.stderr, flush=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="osscar", description="One-shot structured pruning (OSSCAR).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compare the layer solvers on a real model (no downloads)")
    demo.add_argument("--ratio", type=float, default=0.5, help="fraction of groups pruned per layer")
    demo.add_argument("--model", type=Path, default=None,
                      help="a local BERT-like HF model directory (default: the embedded all-MiniLM-L6-v2)")
    demo.set_defaults(func=_demo)

    from compressor.calibration import IMAGENET_MEAN, IMAGENET_STD

    comp = sub.add_parser("compress", help="prune a model physically and export it to ONNX")
    comp.add_argument("model", help="a .pt2 torch.export program, a Hugging Face model directory or cached hub "
                      "id, or torchvision:<name>")
    comp.add_argument("--uniform-ratio", type=float, required=True,
                      help="fraction of each prunable layer's channels removed (rounded, >= 1 kept)")
    comp.add_argument("--calibration", type=Path, required=True,
                      help="images: .npz with x uint8 NHWC, or .npy float32 NCHW used as-is; text (transformers): "
                      ".txt/.jsonl through the model's tokenizer, or token ids as .npz (ids, offsets) / .npy")
    comp.add_argument("--method", default="osscar", choices=("osscar", "mp", "mp+", "thinet"))
    comp.add_argument("--out", type=Path, required=True, help="output directory")
    comp.add_argument("--samples", type=int, default=500, help="calibration images drawn (default 500)")
    comp.add_argument("--seed", type=int, default=0, help="seed of the calibration draw")
    comp.add_argument("--mean", type=_floats, default=IMAGENET_MEAN, help="per-channel mean for .npz images")
    comp.add_argument("--std", type=_floats, default=IMAGENET_STD, help="per-channel std for .npz images")
    comp.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    comp.add_argument("--batch-size", type=int, default=100, help="calibration batch size (images)")
    comp.add_argument("--sequences", type=int, default=128, help="text calibration: sequences drawn (default 128)")
    comp.add_argument("--sequence-length", type=int, default=128, help="text calibration: tokens per sequence")
    comp.add_argument("--stream", action="store_true",
                      help="transformers: read one block at a time from the safetensors shards and write it back "
                      "pruned (memory bounded by a block, for models larger than RAM)")
    comp.add_argument("--activation-dtype", default="float32", choices=("float32", "float16"),
                      help="transformers: dtype of the calibration activations kept on the CPU between blocks")
    comp.set_defaults(func=_compress)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:  # bad input: one line, no traceback
        print(f"osscar: error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
