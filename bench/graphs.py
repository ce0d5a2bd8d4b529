"""Time ONNX graphs of a text model side by side: ours (fused and as exported) against reference exports
(Optimum's, ONNX Runtime's transformer optimizer), interleaved in one process on the same input, with each
graph's outputs compared to the first graph of its model.

    .venv/bin/python bench/graphs.py --shape 8x128 --repeats 15 \\
        dense=out/job/dense.onnx pruned=out/job/model.onnx dense-optimum=/tmp/optimum/model.onnx ...

Image models take `--shape 64x0` (batch 64 of the graph's image size). A name's part before the first "-" is
its model: graphs of one model are checked against each other (max |difference| of the first output). Prints the
median of each graph and the ratios of every graph of another model to the first one of "dense".
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np

log = logging.getLogger("bench.graphs")


def _feed(session, batch: int, sequence: int, vocab: int) -> dict[str, np.ndarray]:
    """Token inputs of batch x sequence; a float input (images) gets `batch` samples of its fixed other dims."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, vocab, size=(batch, sequence), dtype=np.int64)
    values = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids),
              "position_ids": np.broadcast_to(np.arange(sequence, dtype=np.int64), ids.shape).copy()}
    feed = {}
    for i in session.get_inputs():
        if i.type == "tensor(float)":
            feed[i.name] = rng.standard_normal((batch, *i.shape[1:])).astype(np.float32)
        else:
            feed[i.name] = values[i.name]
    return feed


def main(argv: list[str] | None = None) -> None:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("graphs", nargs="+", help="name=path.onnx")
    parser.add_argument("--shape", default="8x128", help="batch x sequence (images: batch x anything)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=30000, help="token ids are drawn below this")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    batch, sequence = (int(v) for v in args.shape.split("x"))
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    # as the job times (exporters.runtime): an idle session's spinning workers would steal the timed one's cores
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sessions = {}
    for spec in args.graphs:
        name, path = spec.split("=", 1)
        sessions[name] = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    outputs = {name: s.run(None, _feed(s, batch, sequence, args.vocab))[0] for name, s in sessions.items()}
    first: dict[str, str] = {}
    for name, out in outputs.items():
        model = name.split("-")[0]
        reference = first.setdefault(model, name)
        if reference != name:
            log.info("%s vs %s: max |difference| %.3g", name, reference, float(np.abs(out - outputs[reference]).max()))
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(args.repeats):  # interleaved: a noisy stretch of the machine hits every graph alike
        for name, session in sessions.items():
            feed = _feed(session, batch, sequence, args.vocab)
            start = time.perf_counter()
            session.run(None, feed)
            times[name].append(1000 * (time.perf_counter() - start))
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians.get(first.get("dense", ""))
    for name, ms in medians.items():
        ratio = f"  dense/this {base / ms:.2f}x" if base and not name.startswith("dense") else ""
        log.info("%-28s %8.1f ms%s", name, ms, ratio)


if __name__ == "__main__":
    main()
