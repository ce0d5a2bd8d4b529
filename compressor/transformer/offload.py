"""Prune a HF checkpoint block by block: blocks are read one at a time from its safetensors shards and
written back pruned, so the pruning's peak memory is one block (twice: dense copy and pruned) plus the
calibration activations, whatever the model size. (A service job still loads the dense model once, for its
ONNX baseline and depth planning: streaming bounds the solve, not that load.)

Life cycle: `StreamedCheckpoint(source_dir, out_dir)` builds the model with its blocks on the meta
device (no memory) and everything else loaded; `prune_blocks(checkpoint, ...)` calls `load(i)` /
`store(i)` around each block; `finish()` writes config, tokenizer files, the non-block weights, the
width manifest and the shard index, after which `load_pruned(out_dir)` rebuilds the pruned model.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ModelReferenceError, UnsupportedArchitecture
from ..modules import owner_of
from .adapters import adapter_for, layers, layers_path, submodule
from .models import build_hf_model, hf_model_class
from .surgery import MANIFEST, per_layer_overrides, restate_depth, save_config_and_widths, settable, state_to_save

log = logging.getLogger(__name__)

# streaming turns on by itself when pruning in memory (the dense model and its pruned copy: twice the
# checkpoint's bytes) would take more than this share of the host's available memory; the rest is left to the
# exports (a float32 copy of a bf16 model), ONNX Runtime and the calibration activations
STREAM_SHARE = 0.5


def checkpoint_bytes(directory: str | Path) -> int:
    """Bytes of a HF directory's safetensors weights (as stored: a bf16 checkpoint counts 2 bytes a weight): the
    shards its index names where it has one (a Mistral download also holds consolidated.safetensors, the same
    weights again), else every safetensors file."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return sum((directory / name).stat().st_size for name in shards if (directory / name).is_file())
    if (directory / "model.safetensors").is_file():  # what a load reads, not a consolidated copy beside it
        return (directory / "model.safetensors").stat().st_size
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def available_memory(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes the host can still give this process: MemAvailable (total physical memory where it is not known), or
    less where the process's memory cgroup is limited (a container capped at 16 GiB on a 512 GiB node is killed at
    its limit, whatever the node has free)."""
    host = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                host = int(line.split()[1]) * 1024
    except OSError:
        pass
    if host is None:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    container = _cgroup_available(cgroup)
    return host if container is None else min(host, container)


def _cgroup_available(root: Path) -> int | None:
    """The memory cgroup's limit less its usage (v2: memory.max / memory.current; v1: memory/limit_in_bytes and
    usage_in_bytes); None where there is no limit or no cgroup to read."""
    for limit, usage in ((root / "memory.max", root / "memory.current"),
                         (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes")):
        try:
            text = limit.read_text().strip()
            if text == "max" or int(text) >= 2**60:  # v2's "max", v1's page-rounded 2^63: no limit
                return None
            return max(0, int(text) - int(usage.read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def needs_streaming(directory: str | Path, share: float = STREAM_SHARE) -> bool:
    """Whether pruning the checkpoint in memory would exceed `share` of the available memory (`STREAM_SHARE`)."""
    return 2 * checkpoint_bytes(directory) > share * available_memory()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "spm.model", "sentencepiece.bpe.model",
                   "chat_template.jinja")


# safetensors' dtype names -> torch's
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def _config_dtype(config: Any) -> torch.dtype | None:
    """The dtype a config states (`dtype`, or a name of one), or None."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


# transformers' conversion operations that a streamed block applies as it reads a Mixture-of-Experts layer's
# experts: one tensor per expert stacked into a 3-D tensor, gate and up concatenated (Qwen3-MoE's, Mixtral's,
# DeepSeek-V3's checkpoints, as every save_pretrained of transformers 5 writes them)
_EXPERT_MERGES = {"MergeModulelist", "Concatenate"}


def _in_model(name: str, expected: set[str], base: str) -> str:
    """A checkpoint name (renamed) as the model names it: with or without the base model's prefix."""
    if name not in expected and base and f"{base}.{name}" in expected:
        return f"{base}.{name}"
    if name not in expected and base and name.startswith(f"{base}.") and name[len(base) + 1:] in expected:
        return name[len(base) + 1:]  # a task model's checkpoint (BertForMaskedLM's `bert.`) for its base
    return name


@dataclass
class _MergedTensor:
    """A model tensor that from_pretrained merges from several checkpoint tensors (a MoE layer's `gate_up_proj` from
    every expert's gate_proj and up_proj): its parts by source pattern and expert index, merged by the conversion's
    own operations, so a streamed block holds what an in-memory load holds."""

    transform: Any  # transformers' WeightConverter
    # source pattern -> expert index -> (checkpoint name, its shard)
    parts: dict[str, dict[int, tuple[str, str]]] = field(default_factory=lambda: defaultdict(dict))

    def check(self, name: str, source: Path, shape: tuple[int, ...] | None) -> None:
        """Every source pattern stored for each of the model's experts 0..E-1 (E: `shape`'s first size, the merged
        tensor's in the model): a missing expert would shift the rest, or fail as its block is read, hours in."""
        found_max = max((max(found) + 1 for found in self.parts.values()), default=0)
        experts = shape[0] if shape else found_max
        gaps = {pattern: sorted(set(range(experts)) - set(self.parts.get(pattern, {})))
                for pattern in self.transform.source_patterns}
        gaps = {pattern: missing for pattern, missing in gaps.items() if missing}
        if found_max > experts:
            raise ModelReferenceError(f"{source}: {name} is merged from {experts} experts, but the checkpoint stores "
                                      f"{found_max}: another model's shards")
        if gaps:
            said = "; ".join(f"{pattern}: experts {missing[:5]}" for pattern, missing in gaps.items())
            raise ModelReferenceError(f"{source}: {name} is merged from every expert's "
                                      f"{' and '.join(self.transform.source_patterns)}, but the checkpoint lacks "
                                      f"{said}")

    def stored(self) -> dict[str, str]:
        return dict(part for found in self.parts.values() for part in found.values())

    def assemble(self, name: str, read: dict[str, Tensor]) -> Tensor:
        collected: dict[str, Any] = {pattern: [read.pop(found[i][0]) for i in sorted(found)]
                                     for pattern, found in self.parts.items()}
        for op in self.transform.operations:
            collected = op.convert(collected, source_patterns=list(self.transform.source_patterns),
                                   target_patterns=list(self.transform.target_patterns), full_layer_name=name,
                                   model=None, config=None, missing_keys=None)
        (tensor,) = collected.values()
        return tensor


def _few_blocks_config(config: Any) -> tuple[Any, int]:
    """A copy of `config` building as few blocks as it can: one, or one of each layer kind where the config states
    fields per layer (Gemma 4's `per_layer_config`: its model builds rotary tables per kind and checks every kind it
    caches has a layer), each block's per-layer fields those of the first layer of its kind; and how many."""
    small = copy.deepcopy(config)
    if not getattr(config, "is_heterogeneous", False):
        small.num_hidden_layers = 1
        return small, 1
    kinds = list(config.layer_types)
    firsts = sorted({kinds.index(kind) for kind in kinds})
    overrides = per_layer_overrides(config)
    small.per_layer_config = None
    small.num_hidden_layers = len(firsts)
    small.layer_types = [kinds[i] for i in firsts]
    small.per_layer_config = {new: overrides[old] for new, old in enumerate(firsts) if old in overrides}
    return small, len(firsts)


def _restate_layer_fields(small: Any, config: Any) -> None:
    """`small` (the few-blocks model's config) given `config`'s depth and per-layer fields again."""
    overrides = per_layer_overrides(config)
    if overrides is not None:
        small.per_layer_config = None
    small.num_hidden_layers = config.num_hidden_layers
    # (a config computing layer_types, from its depth or from keys of its own, restates them with those)
    if isinstance(getattr(config, "layer_types", None), list) and settable(small, "layer_types"):
        small.layer_types = list(config.layer_types)
    if overrides is not None:
        small.per_layer_config = overrides


def _widen_layer_outputs(model: nn.Module, built: int, count: int) -> None:
    """The modules beside the blocks holding one output block per layer (`FamilyAdapter.layer_outputs`: Gemma 4's
    per-layer input embeddings), built for `built` layers, given the shape of `count` (their weights are read from
    the checkpoint next)."""
    owner = owner_of(model, layers_path(model))[0]
    for path in adapter_for(model).layer_outputs:
        module = submodule(owner, path)
        if module is None:
            continue
        weight = module.weight
        if isinstance(module, nn.Embedding):
            shape = (weight.shape[0], weight.shape[1] // built * count)
            module.embedding_dim = shape[1]
        else:
            shape = (weight.shape[0] // built * count, weight.shape[1])
            module.out_features = shape[0]
        module.weight = nn.Parameter(torch.empty(shape, dtype=weight.dtype, device=weight.device),
                                     requires_grad=weight.requires_grad)


class StreamedCheckpoint:
    """A `BlockSource` over a local HF directory of safetensors weights (see the module docstring)."""

    def __init__(self, source: str | Path, out_dir: str | Path) -> None:
        import transformers
        from safetensors import safe_open

        self.source, self.out_dir = Path(source), Path(out_dir)
        if (self.source / MANIFEST).is_file():
            raise UnsupportedArchitecture(f"{source}: a pruned model with layers of their own widths "
                                          "(osscar_widths.json) is not streamed: its blocks are built from a config "
                                          "that states one width (compress it without --stream)")
        config = transformers.AutoConfig.from_pretrained(self.source, local_files_only=True)
        cls, _ = hf_model_class(config)
        # where every tensor is (the index of a sharded checkpoint, or the one file) and its dtype
        index = self.source / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.source / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"{self.source}: no model.safetensors or model.safetensors.index.json "
                                    "(streaming needs safetensors weights)")
        self.where: dict[str, str] = {}
        self._source_name: dict[str, str] = {}  # model name -> checkpoint name
        self._merged: dict[str, _MergedTensor] = {}  # model name -> the checkpoint tensors it is merged from
        first_floating: torch.dtype | None = None
        for name in files:
            with safe_open(str(self.source / name), "pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    self.where[key] = name
                    if first_floating is None:
                        dtype = _SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())
                        first_floating = dtype if dtype is not None and dtype.is_floating_point else None
        # the model's dtype as an in-memory load's `dtype="auto"` takes it: the config's, else the first floating
        # tensor's; every floating tensor is built, pruned and saved in it (a config without one built a bf16
        # checkpoint in float32, twice the memory, and saved float32 where the in-memory job saves bf16)
        config.dtype = _config_dtype(config) or first_floating or torch.float32
        self.dtype: torch.dtype = config.dtype
        # the blocks as meta tensors: shapes without memory
        with torch.device("meta"):
            skeleton = build_hf_model(cls, config, init_weights=False)
        adapter = adapter_for(skeleton)
        if adapter.stage_blocks is not None:
            raise UnsupportedArchitecture(f"{source}: {config.model_type}'s blocks sit in stages, which are not "
                                          "streamed (it is pruned in memory: compress without --stream)")
        if adapter.layer_columns:
            raise UnsupportedArchitecture(f"{source}: {config.model_type}'s {', '.join(adapter.layer_columns)} reads "
                                          "every layer, narrowed as layers go, which a streamed checkpoint rereads "
                                          "whole as it is written: it is pruned in memory (compress without --stream, "
                                          "on a host with the memory for it)")
        # everything but the blocks, real (non-persistent buffers such as rotary tables included), from
        # a one-block model; its block is the template for those buffers
        small_config, kept = _few_blocks_config(config)
        self.model = build_hf_model(cls, small_config, init_weights=False)  # every weight is read next
        self._template = layers(self.model)[0]
        owner, name = owner_of(self.model, layers_path(self.model))
        setattr(owner, name, layers(skeleton))
        _restate_layer_fields(self.model.config, config)
        restate_depth(self.model)
        _widen_layer_outputs(self.model, kept, config.num_hidden_layers)
        adapter_for(self.model)  # refuses unsupported families before any work
        self.where = self._model_names(self.where)
        self.prefix = layers_path(self.model) + "."
        absent = [name for name in self.model.state_dict() if name.startswith(self.prefix)
                  and name not in self.where and name not in self._merged]
        if absent:  # as the checkpoint opens, not as that block is read, hours in
            raise ModelReferenceError(f"{self.source}: the checkpoint lacks {len(absent)} tensors of the blocks, "
                                      f"e.g. {absent[:5]}")
        self._weight_map: dict[str, str] = {}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._load_rest()
        self._released = False  # the weights outside the blocks are on the meta device (`release_rest`)

    def _model_names(self, where: dict[str, str]) -> dict[str, str]:
        """Checkpoint tensor names -> the model's names, as from_pretrained renames them (legacy layouts,
        e.g. ViT's encoder.layer.N.attention.attention.query; checkpoints of the base model without the
        task model's prefix). A Mixture-of-Experts layer's experts, stored one tensor per expert and merged into 3-D
        tensors as they load, are merged the same way as their block is read (`_MergedTensor`); other conversions
        that merge or split tensors cannot be streamed."""
        from transformers.conversion_mapping import get_model_conversion_mapping

        renames, merges = [], []
        for transform in get_model_conversion_mapping(self.model):
            kind = type(transform).__name__
            ops = {type(op).__name__ for op in getattr(transform, "operations", ())}
            sources = list(getattr(transform, "source_patterns", ()))
            if kind == "WeightConverter" and "MergeModulelist" in ops and ops <= _EXPERT_MERGES and all(
                    source.count("*") == 1 and "\\" not in source for source in sources):
                # `*` stands for the expert's index (transformers' own reading of these plain patterns)
                merges += [(re.compile(re.escape(source).replace(r"\*", r"(\d+)") + r"(?!\w)"), source, transform)
                           for source in sources]
                continue
            if kind not in ("WeightRenaming", "PrefixChange"):  # a prefix added or removed: a renaming's regex
                raise ModelReferenceError(f"{self.source}: loading this checkpoint converts tensors "
                                          f"({kind}: {', '.join(sorted(ops))}); stream a checkpoint saved by this "
                                          "transformers version instead")
            sources, targets = list(transform.source_patterns), list(transform.target_patterns)
            targets = targets * len(sources) if len(targets) == 1 else targets  # many sources, one target
            renames += [(re.compile(source), target) for source, target in zip(sources, targets, strict=True)]
        state = self.model.state_dict()  # the blocks' tensors on the meta device: names and shapes, no memory
        expected = set(state)
        base = getattr(self.model, "base_model_prefix", "")
        out = {}
        for key, file in where.items():
            name = key
            for pattern, target in renames:
                name = pattern.sub(target, name)
            merged = next(((m, source, transform) for pattern, source, transform in merges
                           if (m := pattern.search(name))), None)
            if merged is not None:  # one expert's part of a merged tensor
                m, source, transform = merged
                (target,) = transform.target_patterns
                name = _in_model(name[:m.start()] + target + name[m.end():], expected, base)
                entry = self._merged.setdefault(name, _MergedTensor(transform))
                entry.parts[source][int(m.group(1))] = (key, file)
                continue
            name = _in_model(name, expected, base)
            self._source_name[name] = key
            out[name] = file
        for name, entry in self._merged.items():
            entry.check(name, self.source, tuple(state[name].shape) if name in state else None)
        return out

    def _read(self, keys: list[str]) -> dict[str, Tensor]:
        """Tensors by name; each shard is mapped only while it is read (its pages then leave RSS)."""
        from safetensors import safe_open

        missing = [k for k in keys if k not in self.where and k not in self._merged]
        if missing:
            raise ModelReferenceError(f"{self.source}: the checkpoint lacks {len(missing)} tensors the model "
                                      f"expects, e.g. {missing[:5]}")
        plain = [k for k in keys if k not in self._merged]
        # checkpoint name -> its shard, for the plain tensors and every part of the merged ones
        wanted = {self._source_name.get(k, k): self.where[k] for k in plain}
        for key in keys:
            if key in self._merged:
                wanted.update(self._merged[key].stored())
        by_file: dict[str, list[str]] = defaultdict(list)
        for stored, file in wanted.items():
            by_file[file].append(stored)
        read = {}
        for name, names in by_file.items():
            with safe_open(str(self.source / name), "pt", device="cpu") as f:
                for stored in names:
                    read[stored] = f.get_tensor(stored)
        out = {k: read.pop(self._source_name.get(k, k)) for k in plain}
        for key in keys:
            if key in self._merged:
                out[key] = self._merged[key].assemble(key, read)
        return out

    def _load_rest(self) -> None:
        # each tensor once, under its first name (`tied_aliases` drops the others), read under whichever of its
        # names the checkpoint stores (some exporters keep a tied weight as `lm_head.weight` alone), as
        # from_pretrained reads it
        names: dict[int, list[str]] = defaultdict(list)
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            names[id(tensor)].append(name)
        aliases = {alias for group in names.values() for alias in group[1:]}
        stored = {group[0]: next((n for n in group if n in self.where), group[0]) for group in names.values()}
        keys = [k for k in stored if not k.startswith(self.prefix)]
        keys = [k for k in keys if k in self.where or not k.endswith("num_batches_tracked")]
        read = self._read([stored[k] for k in keys])
        state = {k: read[stored[k]] for k in keys}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith(self.prefix) and k not in aliases]
        if missing or unexpected:
            raise ModelReferenceError(f"{self.source}: non-block weights do not match (missing {missing[:5]}, "
                                      f"unexpected {unexpected[:5]})")

    def load(self, index: int) -> nn.Module:
        block = layers(self.model)[index].to_empty(device="cpu")
        prefix = f"{self.prefix}{index}."
        state = self._read([prefix + k for k in block.state_dict()])
        block.load_state_dict({k[len(prefix):]: v for k, v in state.items()}, strict=True)
        persistent = set(self._template.state_dict())
        for name, buffer in self._template.named_buffers():
            if name not in persistent:  # e.g. causal masks: not in the checkpoint, rebuilt from the template
                owner, attr = owner_of(block, name)
                owner._buffers[attr] = buffer.clone()
        return block

    def _save(self, state: dict[str, Tensor], filename: str) -> None:
        from safetensors.torch import save_file

        state = {k: v.to("cpu", self.dtype if v.is_floating_point() else v.dtype).contiguous()
                 for k, v in state.items()}
        tmp = self.out_dir / f".{filename}.tmp"
        save_file(state, str(tmp), metadata={"format": "pt"})
        tmp.replace(self.out_dir / filename)  # no partial shard is ever visible under its name
        self._weight_map.update(dict.fromkeys(state, filename))

    def release_rest(self) -> None:
        """The weights outside the blocks (embeddings, LM head, final norm) go to the meta device: only the
        first block's inputs needed them, and `finish` reads them from the shards again (pruning never changes
        them). A Llama-3.2-1B's tied embeddings are 0.5 GB of bf16, four bf16 blocks. Tied weights stay tied;
        buffers (rotary tables, position ids: small, and some not in the checkpoint) stay."""
        self._released = self._replace_rest(meta=False, make=lambda p: p.to("meta")) or self._released

    def _replace_rest(self, meta: bool, make: Callable[[Tensor], Tensor]) -> int:
        """Replace each parameter outside the blocks that is (`meta`) or is not on the meta device by a new one
        made from it, once per tensor, so that tied weights stay tied; returns how many were replaced."""
        new: dict[int, nn.Parameter] = {}
        for name, param in list(self.model.named_parameters(remove_duplicate=False)):
            if name.startswith(self.prefix) or param.is_meta != meta:
                continue
            if id(param) not in new:
                new[id(param)] = nn.Parameter(make(param), requires_grad=param.requires_grad)
            owner, attr = owner_of(self.model, name)
            owner._parameters[attr] = new[id(param)]
        return len(new)

    def _restore_rest(self) -> None:
        """What `release_rest` released, read from the shards again into CPU tensors of its dtype."""
        self._replace_rest(meta=True, make=lambda p: torch.empty_like(p, device="cpu"))
        self._load_rest()
        self._released = False

    def store(self, index: int) -> None:
        block = layers(self.model)[index]
        self._save(state_to_save(block, prefix=f"{self.prefix}{index}."), f"model-block-{index:05d}.safetensors")
        block.to("meta")  # shapes (the widths) stay, memory goes

    def finish(self) -> Path:
        """Write what `load_pruned` needs besides the blocks; returns the output directory."""
        if self._released:
            self._restore_rest()
        rest = {k: v for k, v in state_to_save(self.model).items() if not k.startswith(self.prefix)}
        self._save(rest, "model-rest.safetensors")
        save_config_and_widths(self.model, self.out_dir)
        for name in ("generation_config.json", *TOKENIZER_FILES):
            if (self.source / name).is_file():
                shutil.copy(self.source / name, self.out_dir)
        total = sum((self.out_dir / name).stat().st_size for name in set(self._weight_map.values()))
        index = {"metadata": {"total_size": total}, "weight_map": self._weight_map}  # from_pretrained reads both
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        return self.out_dir
