"""Levers measured against issue 33's SmolLM2-135M row (WikiText-2 <= 54 at 1.25x), outside a job.

Each subcommand measures one lever on the SmolLM2 protocol (`quality_transformers`: WikiText-2 perplexity of 64
windows of 256 tokens in PyTorch, dense 35.81; C4 perplexity of 64 further windows of 256 tokens, none a calibration
window; calibration 128 C4 windows of 128 tokens, as a job draws them):

- `slice`: the residual stream's width cut with one rotation for the whole model (SliceGPT's idea without its
  per-layer rotations, so that the result is a standard Llama of a smaller `hidden_size`): the principal directions
  of every norm's input (each token scaled to unit norm, since the norms divide it out), the norms' weights folded
  into the projections that read them, the kept directions' coordinates everywhere.
- `fit`: the whole-model fit of the next-token distributions (`reconstruct_model`, target "logits") from the same
  osscar model at uniform `--ratio` with block fits, stepping through more C4 windows (a job's pool) or through the
  dense model's own samples, at one or more step sizes; `--norms` fits the norms' weights too.
- `block-steps`: osscar at uniform `--ratio` with a fixed number of block-fit steps per block.
- `kl-alloc`: an allocation of widths from measured end-to-end sensitivities: every layer's attention and FFN pruned
  alone (osscar's solve on the dense model's statistics) to a few widths, the next-token KL from the dense model on
  C4 windows the calibration does not hold; widths then chosen to minimise the summed KL at the multiply-adds a
  job's allocation (`--job-report`) saves, and both structures pruned and fitted alike.

The pruned model, the samples and the sensitivities are kept in `--work` for the next run. Results: bench/RESULTS.md,
sessions 41 (`slice`, `fit`, `block-steps`) and 42 (`kl-alloc`).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _setup() -> tuple:
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    import quality_transformers as q
    import transformers

    from compressor.calibration import load_text, without_seen

    path = q.smollm2_directory()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    dense = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    c4 = q.DATA / "text" / "c4-validation-2000.jsonl"
    calibration = load_text(c4, tokenizer=tokenizer, sequences=128, length=128, seed=0)
    held = without_seen(load_text(c4, tokenizer=tokenizer, sequences=64, length=256, seed=7), calibration)
    wikitext = [{"input_ids": w} for w in q.wikitext_windows(tokenizer).split(8)]
    return tokenizer, dense, calibration, held, wikitext, c4


def perplexity(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """exp of the mean next-token loss over the tokens of `batches` (padding masked out)."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            ids = batch["input_ids"]
            mask = batch.get("attention_mask", torch.ones_like(ids))
            labels = ids.masked_fill(mask == 0, -100)
            scored = int((labels[:, 1:] != -100).sum())
            nll += float(model(input_ids=ids, attention_mask=mask, labels=labels).loss) * scored
            count += scored
    return math.exp(nll / count)


def _say(tag: str, model: torch.nn.Module, wikitext: list, held: list) -> None:
    print(f"{tag}: WikiText-2 {perplexity(model, wikitext):.2f}, C4 {perplexity(model, held):.2f}", flush=True)


def _run_hooked(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], hooks: list,
                mask: dict[str, torch.Tensor]) -> None:
    """`model` over `batches` with `hooks` in place (removed after), `mask["m"]` each batch's counted tokens."""
    try:
        with torch.no_grad():
            for batch in batches:
                mask["m"] = batch["attention_mask"].bool()
                model(**batch)
    finally:
        for hook in hooks:
            hook.remove()


def rotation(dense: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """(hidden, hidden) orthogonal, columns by descending energy of the unit-norm tokens every norm reads."""
    d = dense.config.hidden_size
    energy = torch.zeros(d, d, dtype=torch.float64)
    mask: dict[str, torch.Tensor] = {}

    def read(module: torch.nn.Module, args: tuple) -> None:
        x = args[0].detach().double()[mask["m"]]  # (tokens, hidden)
        x = x / x.norm(dim=-1, keepdim=True)
        energy.add_(x.T @ x)

    norms = [n for layer in dense.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    _run_hooked(dense, batches, [n.register_forward_pre_hook(read) for n in [*norms, dense.model.norm]], mask)
    values, vectors = torch.linalg.eigh(energy)
    return vectors[:, torch.argsort(values, descending=True)].float()


def sliced(dense: torch.nn.Module, q: torch.Tensor, width: int) -> torch.nn.Module:
    """A Llama of hidden size `width` on the first `width` columns of `q` (untied: the final norm's weight folds
    into the head). A norm now divides by the kept coordinates' RMS: its weight sqrt(d / width) restores the scale."""
    import transformers

    config = dense.config
    d = config.hidden_size
    small = transformers.LlamaConfig(**{**config.to_dict(), "hidden_size": width, "tie_word_embeddings": False,
                                        "head_dim": config.head_dim or d // config.num_attention_heads})
    model = transformers.LlamaForCausalLM(small).eval()
    qs, scale = q[:, :width], math.sqrt(d / width)  # (d, width)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(dense.model.embed_tokens.weight @ qs)
        for old, new in zip(dense.model.layers, model.model.layers, strict=True):
            g1, g2 = old.input_layernorm.weight, old.post_attention_layernorm.weight
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(new.self_attn, name).weight.copy_(getattr(old.self_attn, name).weight * g1 @ qs)
            new.self_attn.o_proj.weight.copy_(qs.T @ old.self_attn.o_proj.weight)
            for name in ("gate_proj", "up_proj"):
                getattr(new.mlp, name).weight.copy_(getattr(old.mlp, name).weight * g2 @ qs)
            new.mlp.down_proj.weight.copy_(qs.T @ old.mlp.down_proj.weight)
            new.input_layernorm.weight.fill_(scale)
            new.post_attention_layernorm.weight.fill_(scale)
        model.model.norm.weight.fill_(scale)
        model.lm_head.weight.copy_(dense.lm_head.weight * dense.model.norm.weight @ qs)
    return model


def _pruned(dense, calibration, ratio: float, steps: int, work: Path | None) -> torch.nn.Module:
    from compressor.refine import RefineConfig
    from compressor.transformer.attention import register
    from compressor.transformer.pipeline import prune_transformer

    register()  # a pickled pruned model names the gathered attention
    cached = work / f"osscar-{ratio}-{steps}.pt" if work else None
    if cached is not None and cached.is_file():
        return torch.load(cached, weights_only=False)
    start = time.perf_counter()
    pruned, layers = prune_transformer(dense, calibration, ratio, method="osscar", refine=RefineConfig(steps=steps),
                                       choose_rows=True)
    fits = [r.refine for r in layers if r.refine is not None]
    print(f"osscar {ratio}, {steps} block-fit steps: prune {time.perf_counter() - start:.0f} s, fits "
          f"{sum(f.seconds for f in fits):.0f} s, {sum(f.kept for f in fits)} of {len(fits)} kept", flush=True)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        torch.save(pruned, cached)
    return pruned


def samples(dense, tokenizer, count: int, length: int, work: Path | None) -> torch.Tensor:
    """(count, length) token ids sampled from the dense model at temperature 1 from its first token."""
    cached = work / f"samples-{count}x{length}.pt" if work else None
    if cached is not None and cached.is_file():
        return torch.load(cached)
    first = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    start, out = time.perf_counter(), []
    for n in range(0, count, 64):
        prompt = torch.full((min(64, count - n), 1), first)
        with torch.no_grad():
            drawn = dense.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0,
                                   top_k=0, top_p=1.0, max_new_tokens=length, min_new_tokens=length,
                                   pad_token_id=first)
        out.append(drawn[:, 1:length + 1])
    ids = torch.cat(out)
    print(f"{count} samples of {length} tokens in {time.perf_counter() - start:.0f} s", flush=True)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        torch.save(ids, cached)
    return ids


HEAD_LEVELS = (6, 3, 1)  # kl-alloc: query heads kept (of 9) where a layer's attention is pruned alone
FFN_LEVELS = (1024, 512, 192)  # kl-alloc: FFN neurons kept (of 1,536)


def _log_probs(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [torch.log_softmax(model(**b).logits.float(), dim=-1) for b in batches]


def _kl(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], dense: list[torch.Tensor]) -> float:
    """Mean KL(dense || model) per counted token."""
    total, count = 0.0, 0
    for batch, lp, ld in zip(batches, _log_probs(model, batches), dense, strict=True):
        m = batch["attention_mask"].bool()
        total += float((ld.exp() * (ld - lp)).sum(-1)[m].sum())
        count += int(m.sum())
    return total / count


def _hessians(dense: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """X^T X (float64) of every o_proj's and down_proj's input over the counted calibration tokens."""
    H: dict[str, torch.Tensor] = {}
    mask: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def read(module: torch.nn.Module, args: tuple) -> None:
            x = args[0].detach().double()[mask["m"]]  # (tokens, in)
            H[name] = H.get(name, 0) + x.T @ x
        return read

    hooks = []
    for i, layer in enumerate(dense.model.layers):
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(hook(f"model.layers.{i}.self_attn.o_proj")))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(hook(f"model.layers.{i}.mlp.down_proj")))
    _run_hooked(dense, batches, hooks, mask)
    return H


def _alone(dense: torch.nn.Module, index: int, kind: str, H: torch.Tensor, rows: int, keep: int) -> torch.nn.Module:
    """A copy of `dense` with one projection of block `index` solved by osscar to `keep` groups."""
    from compressor.layerstats import FinishedStatistics, kept_solution
    from compressor.solver.solve import solve_layer
    from compressor.transformer.surgery import prune_ffn, prune_query_heads

    model = copy.deepcopy(dense)
    layer = model.model.layers[index]
    proj = layer.self_attn.o_proj if kind == "attention_heads" else layer.mlp.down_proj
    g = model.config.head_dim if kind == "attention_heads" else 1
    W = proj.weight.detach().double().T  # (in, out)
    G = H @ W
    sol = solve_layer(H, G, g, H.shape[0] // g - keep, "osscar", dense_weight=W, rank=rows)
    zero = torch.zeros(W.shape[0], dtype=W.dtype)
    kept = kept_solution(sol, g, None, FinishedStatistics(H, G, 0.0, zero, torch.zeros(W.shape[1]), rows))
    (prune_query_heads if kind == "attention_heads" else prune_ffn)(model, index, kept.keep, kept.weight.T.float())
    return model


def sensitivities(dense, calibration, probe, work: Path | None) -> dict[tuple[int, str], dict[int, float]]:
    """KL(dense || one unit pruned) on `probe` for each layer's attention and FFN at the levels above."""
    import json

    cached = work / "kl-sensitivities.json" if work else None
    if cached is not None and cached.is_file():
        raw = json.loads(cached.read_text())
        return {(int(k.split(":")[0]), k.split(":")[1]): {int(w): v for w, v in c.items()} for k, c in raw.items()}
    start = time.perf_counter()
    H = _hessians(dense, calibration)
    rows = sum(int(b["attention_mask"].sum()) for b in calibration)
    reference = _log_probs(dense, probe)
    print(f"statistics and the dense probe: {time.perf_counter() - start:.0f} s", flush=True)
    out: dict[tuple[int, str], dict[int, float]] = {}
    for i in range(dense.config.num_hidden_layers):
        for kind, name, levels in (("attention_heads", f"model.layers.{i}.self_attn.o_proj", HEAD_LEVELS),
                                   ("ffn_neurons", f"model.layers.{i}.mlp.down_proj", FFN_LEVELS)):
            curve = {}
            for keep in levels:
                curve[keep] = _kl(_alone(dense, i, kind, H[name], rows, keep), probe, reference)
            out[(i, kind)] = curve
            print(f"layer {i} {kind}: " + ", ".join(f"{k} {v:.5f}" for k, v in curve.items())
                  + f" ({time.perf_counter() - start:.0f} s)", flush=True)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps({f"{i}:{k}": c for (i, k), c in out.items()}))
    return out


def kl_widths(dense, curves: dict[tuple[int, str], dict[int, float]], saved: float) -> dict[str, int]:
    """Widths minimising the summed KL (linear between measured widths, none below the narrowest) among those
    saving at least `saved` multiply-adds per token (`group_cost` at 512 tokens, a job's shape)."""
    from compressor.transformer.pipeline import group_cost

    full = {"attention_heads": dense.config.num_attention_heads, "ffn_neurons": dense.config.intermediate_size}
    step = {"attention_heads": 1, "ffn_neurons": 32}
    options = {}  # unit -> [(kept, kl, saved)]
    for (i, kind), curve in curves.items():
        points = sorted({full[kind]: 0.0, **curve}.items())  # (kept, kl) ascending
        cost = group_cost(dense, kind, 512, "query-heads", i)
        opts = []
        for kept in range(points[0][0], full[kind] + 1, step[kind]):
            for (k0, v0), (k1, v1) in itertools.pairwise(points):
                if k0 <= kept <= k1:
                    opts.append((kept, v0 + (v1 - v0) * (kept - k0) / (k1 - k0), (full[kind] - kept) * cost))
                    break
        options[(i, kind)] = opts

    def pick(lam: float) -> tuple[dict, float]:
        chosen = {u: min(o, key=lambda t: t[1] - lam * t[2]) for u, o in options.items()}
        return chosen, sum(t[2] for t in chosen.values())

    lo, hi = 0.0, 1.0
    while pick(hi)[1] < saved:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pick(mid)[1] < saved else (lo, mid)
    chosen, total = pick(hi)
    print(f"kl-alloc: saves {total:.4g} of {saved:.4g} multiply-adds a token, planned KL "
          f"{sum(t[1] for t in chosen.values()):.4f}", flush=True)
    names = {"attention_heads": "self_attn.o_proj", "ffn_neurons": "mlp.down_proj"}
    return {f"model.layers.{i}.{names[k]}": t[0] for (i, k), t in chosen.items()}


def job_widths(dense, report: Path) -> tuple[dict[str, int], set[tuple[int, str]], float]:
    """A job's widths as a plan, its removed sub-layers, and the multiply-adds a token they save."""
    import json

    from compressor.transformer.pipeline import group_cost

    widths = json.loads(report.read_text())["widths"]
    plan, removed, saved = {}, set(), 0.0
    config = dense.config
    for i, (heads, ffn) in enumerate(zip(widths["heads"], widths["ffn"], strict=True)):
        saved += (config.num_attention_heads - heads) * group_cost(dense, "attention_heads", 512, "query-heads", i)
        saved += (config.intermediate_size - ffn) * group_cost(dense, "ffn_neurons", 512, "query-heads", i)
        if heads == 0:
            removed.add((i, "attention_heads"))
        else:
            plan[f"model.layers.{i}.self_attn.o_proj"] = heads
        if ffn == 0:
            removed.add((i, "ffn_neurons"))
        else:
            plan[f"model.layers.{i}.mlp.down_proj"] = ffn
    return plan, removed, saved


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lever", choices=("slice", "fit", "block-steps", "kl-alloc"))
    parser.add_argument("--job-report", type=Path, help="kl-alloc: a job's report.json whose widths it matches")
    parser.add_argument("--widths", default="576,540,504,468", help="slice: hidden sizes (multiples of the heads)")
    parser.add_argument("--ratio", type=float, default=0.2, help="fit, block-steps: osscar's uniform ratio")
    parser.add_argument("--block-steps", type=int, default=50, help="block-fit steps per block")
    parser.add_argument("--pools", default="c4,samples", help="fit: what it steps through besides the calibration")
    parser.add_argument("--lrs", default="2e-4", help="fit: step sizes relative to each weight's RMS")
    parser.add_argument("--steps", type=int, default=60, help="fit: Adam steps of 4 windows")
    parser.add_argument("--samples", type=int, default=512, help="fit: pool windows (C4's or the dense model's)")
    parser.add_argument("--norms", action="store_true", help="fit: the norms' weights too")
    parser.add_argument("--work", type=Path, help="keeps the pruned model and the samples between runs")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tokenizer, dense, calibration, held, wikitext, c4 = _setup()
    from compressor.calibration import load_text, without_seen  # importable once _setup put the root on the path

    _say("dense", dense, wikitext, held)
    if args.lever == "kl-alloc":
        from compressor.refine import RefineConfig
        from compressor.transformer.pipeline import prune_transformer

        if args.job_report is None:
            raise SystemExit("kl-alloc needs --job-report")
        probe = without_seen(load_text(c4, tokenizer=tokenizer, sequences=16, length=128, seed=3), calibration)
        curves = sensitivities(dense, calibration, probe, args.work)
        plan, removed, saved = job_widths(dense, args.job_report)
        plans = {"job": (plan, removed), "kl": (kl_widths(dense, curves, saved), set())}
        for name, (widths, sublayers) in plans.items():
            heads = [widths.get(f"model.layers.{i}.self_attn.o_proj", 0) for i in range(len(dense.model.layers))]
            ffn = [widths.get(f"model.layers.{i}.mlp.down_proj", 0) for i in range(len(dense.model.layers))]
            print(f"{name} widths: heads {heads}, ffn {ffn}", flush=True)
            start = time.perf_counter()
            pruned, _ = prune_transformer(dense, calibration, widths, method="osscar", choose_rows=True,
                                          refine=RefineConfig(steps=args.block_steps), sublayers=sorted(sublayers))
            print(f"{name}: pruned and fitted in {time.perf_counter() - start:.0f} s, "
                  f"{sum(p.numel() for p in pruned.parameters()):,} parameters", flush=True)
            _say(f"{name} allocation, {args.block_steps} block-fit steps", pruned, wikitext, held)
        return
    if args.lever == "slice":
        start = time.perf_counter()
        q = rotation(dense, load_text(c4, tokenizer=tokenizer, sequences=32, length=256, seed=0))
        print(f"rotation: {time.perf_counter() - start:.0f} s", flush=True)
        for width in (int(w) for w in args.widths.split(",")):
            _say(f"hidden {width}", sliced(dense, q, width), wikitext, held)
        return
    pruned = _pruned(dense, calibration, args.ratio, args.block_steps, args.work)
    _say(f"osscar {args.ratio}, {args.block_steps} block-fit steps", pruned, wikitext, held)
    if args.lever == "block-steps":
        return
    from compressor.refine import RefineConfig
    from compressor.transformer.refine import LOGITS_CHECK_EVERY, reconstruct_model

    pools = {}
    for name in args.pools.split(","):
        if name == "c4":
            pools[name] = without_seen(load_text(c4, tokenizer=tokenizer, sequences=args.samples, length=128, seed=2),
                                       calibration)
        elif name == "samples":
            ids = samples(dense, tokenizer, args.samples, 128, args.work)
            pools[name] = [{"input_ids": w, "attention_mask": torch.ones_like(w)} for w in ids.split(16)]
        else:
            raise SystemExit(f"--pools: c4 or samples (got {name!r})")
    for name, pool in pools.items():
        for lr in (float(x) for x in args.lrs.split(",")):
            model, start = copy.deepcopy(pruned), time.perf_counter()
            config = RefineConfig(steps=args.steps, lr=lr, check_every=LOGITS_CHECK_EVERY, norms=args.norms)
            report = reconstruct_model(model, dense, calibration, config, torch.device("cpu"), target="logits",
                                       pool=pool)
            print(f"fit on {name}, step {lr:g}: held-out KL {report.before:.4f} -> {report.after:.4f} "
                  f"({'kept' if report.kept else 'not kept'}), {time.perf_counter() - start:.0f} s", flush=True)
            _say(f"after the fit on {name}, step {lr:g}", model, wikitext, held)


if __name__ == "__main__":
    main()
