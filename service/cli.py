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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="osscar", description="One-shot structured pruning (OSSCAR).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compare the layer solvers on a real model (no downloads)")
    demo.add_argument("--ratio", type=float, default=0.5, help="fraction of groups pruned per layer")
    demo.add_argument("--model", type=Path, default=None,
                      help="a local BERT-like HF model directory (default: the embedded all-MiniLM-L6-v2)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"osscar: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
