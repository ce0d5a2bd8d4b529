"""ONNX Runtime GenAI on a job's directory (`osscar compress ... --decode-step`): greedy tokens from a text prompt,
compared with PyTorch's greedy decode of the same pruned model (`load_pruned` of the job's `model/`), and the
tokens per second of each.

    .venv/bin/python bench/genai.py out/smollm2-0.25 --prompt "The history of the city" --tokens 64

Prints one JSON line: prompt tokens (GenAI's tokenizer and transformers' agree or not), the tokens of each, the
first position where they differ (null: identical), and the seconds of each.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    import numpy as np
    import onnxruntime_genai as og
    import torch
    from transformers import AutoTokenizer

    from compressor.transformer.surgery import load_pruned

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", type=Path, help="the job's output directory (decode.onnx, genai_config.json, model/)")
    parser.add_argument("--prompt", default="The history of the city begins in the")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens to generate")
    args = parser.parse_args(argv)

    model = og.Model(str(args.job))
    prompt = [int(t) for t in og.Tokenizer(model).encode(args.prompt)]
    reference = AutoTokenizer.from_pretrained(args.job / "model")(args.prompt)["input_ids"]
    length = len(prompt) + args.tokens
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=length)
    start = time.perf_counter()
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))  # a multi-token prefill, then one at a time
    while not generator.is_done():
        generator.generate_next_token()
    genai = [int(t) for t in generator.get_sequence(0)]
    genai_s = time.perf_counter() - start

    pruned = load_pruned(args.job / "model").eval()
    start = time.perf_counter()
    with torch.no_grad():
        greedy = pruned.generate(torch.tensor([prompt]), max_length=length, do_sample=False,
                                 pad_token_id=pruned.config.eos_token_id).tolist()[0]
    torch_s = time.perf_counter() - start
    shorter = min(len(genai), len(greedy))
    differ = next((i for i in range(shorter) if genai[i] != greedy[i]), None)
    if differ is None and len(genai) != len(greedy):
        differ = shorter
    print(json.dumps({"prompt_tokens": len(prompt), "tokenizers_agree": prompt == list(reference),
                      "generated": len(genai) - len(prompt), "identical": differ is None, "first_difference": differ,
                      "genai_s": round(genai_s, 2), "torch_s": round(torch_s, 2),
                      "text": og.Tokenizer(model).decode(np.array(genai[len(prompt):], dtype=np.int32))}))


if __name__ == "__main__":
    main()
