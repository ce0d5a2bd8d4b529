"""A pruned checkpoint whose layers kept unequal widths, loaded by plain transformers (no osscar installed):
`modeling_osscar.py` beside config.json, named by its `auto_map`, read with `trust_remote_code=True`.

transformers builds a model from config.json, and a config states one width of each kind for every layer, so
such a checkpoint does not load by itself (size mismatch). Its remote-code mechanism names a class shipped in
the directory instead: ours subclasses the family's own class and, after that class's `__init__`, makes what
pruning changed — a projection resized, a sub-layer's stand-in (`sublayers`), an attention's head count — from
a list of module changes in config.json (`osscar_changes`). The list is found by comparing the pruned model with
the model its saved config builds, module by module, so it needs no family knowledge; where a change is of a
kind the file cannot make (a forward hook, a shared config view), nothing is written and the directory stays as
`surgery.load_pruned` reads it. The file imports torch and transformers only; its stand-in classes are
`sublayers`' own source.
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import sublayers
from .models import write_config

log = logging.getLogger(__name__)

MODULE = "modeling_osscar"  # the file (MODULE.py) and the module name in auto_map
CHANGES = "osscar_changes"  # the config key of the module changes
# the Auto class that loads a model class, by the class name's ending (the base model otherwise)
AUTO_CLASSES = (("ForCausalLM", "AutoModelForCausalLM"), ("LMHeadModel", "AutoModelForCausalLM"),
                ("ForMaskedLM", "AutoModelForMaskedLM"), ("ForSequenceClassification",
                                                         "AutoModelForSequenceClassification"),
                ("ForTokenClassification", "AutoModelForTokenClassification"),
                ("ForImageClassification", "AutoModelForImageClassification"),
                ("ForImageClassificationWithTeacher", "AutoModelForImageClassification"))  # DeiT's, both heads
# module attributes a change may set: numbers and flags a forward reads (head counts, widths)
_ATTRIBUTE_TYPES = (int, float, bool)
_PLAIN = (int, float, bool, str, type(None), tuple, list)  # attributes compared between pruned and dense
_MISSING = object()

_HEADER = '''"""Written by osscar: this directory's pruned {base}, loaded by transformers with `trust_remote_code=True`.
Its layers kept unequal widths, which config.json cannot state, so after {base}'s own __init__ the class below
makes the changes config.json lists under "{changes}" (projections resized, removed sub-layers' stand-ins, head
counts); the weights then load as they were saved. Needs torch and transformers only."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import {base} as _Dense


'''

_FOOTER = '''

def _select_bias_rows(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    at = module.bias_argument
    if kwargs.get("position_bias") is not None:
        bias = kwargs["position_bias"]
        kwargs = {{**kwargs, "position_bias": bias[:, list(module.bias_rows)]}}
    elif len(args) > at and args[at] is not None:
        args = (*args[:at], args[at][:, list(module.bias_rows)], *args[at + 1:])
    return args, kwargs

def _apply(model: nn.Module, changes: list[dict[str, Any]]) -> None:
    for change in changes:
        owner_path, _, name = change["path"].rpartition(".")
        owner = model.get_submodule(owner_path)
        kind = change["kind"]
        if kind == "linear":
            setattr(owner, name, nn.Linear(change["in"], change["out"], bias=change["bias"]))
        elif kind == "removed":
            setattr(owner, name, RemovedSublayer(torch.zeros(change["hidden"]), pair=change["pair"],
                                                 full=change.get("full", False)))
        elif kind == "empty":
            setattr(owner, name, EmptyCore(pair=change["pair"]))
        elif kind == "attributes":
            module = model.get_submodule(change["path"])
            for key, value in change["values"].items():
                setattr(module, key, value)
        elif kind == "bias_rows":  # the kept heads' rows of a score bias computed once for every layer
            module = model.get_submodule(change["path"])
            # rows as data, not a buffer: transformers builds the model on the meta device and leaves a buffer
            # it does not load uninitialised
            module.bias_rows, module.bias_argument = tuple(change["rows"]), change["argument"]
            module.register_forward_pre_hook(_select_bias_rows, with_kwargs=True)
        elif kind == "parameters":  # resized in place; the weights are loaded afterwards
            module = model.get_submodule(change["path"])
            for key, shape in change["shapes"].items():
                old = getattr(module, key)
                setattr(module, key, nn.Parameter(old.new_empty(shape), requires_grad=old.requires_grad))
        else:
            raise ValueError(f"{{change['path']}}: unknown change {{kind!r}} (written by a newer osscar?)")


class {cls}(_Dense):
    def __init__(self, config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        _apply(self, config.{changes})
'''

# the base model alone (AutoModel), where the pruned class is a task model around it: the changes under its prefix
_BASE_CLASS = '''

from transformers import {base} as _DenseBase


class {cls}(_DenseBase):
    def __init__(self, config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        _apply(self, [{{**change, "path": change["path"][len("{prefix}."):]}} for change in config.{changes}
                      if change["path"].startswith("{prefix}.")])
'''


# what `surgery.set_bias_rows` sets beside its hook: a "bias_rows" change says it
_BIAS_ROWS_ATTRIBUTES = ("bias_rows", "bias_argument", "bias_hooked")


def _attributes(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"
            and k not in _BIAS_ROWS_ATTRIBUTES}


def module_changes(pruned: nn.Module, dense: nn.Module) -> list[dict[str, Any]] | None:
    """What turns `dense` (the model the pruned one's config builds) into `pruned`, module by module in
    `named_modules` order (an owner before what it holds); None when a change is not of a kind
    `modeling_osscar.py` makes."""
    from transformers import PreTrainedModel

    changes: list[dict[str, Any]] = []
    dense_modules = dict(dense.named_modules())
    for path, module in pruned.named_modules():
        reference = dense_modules.get(path)
        if reference is None:  # inside a module replaced above, or new
            if not any(path.startswith(c["path"] + ".") for c in changes if c["kind"] != "attributes"):
                log.info("%s: not in the model its config builds", path)
                return None
            continue
        rows = getattr(module, "bias_rows", None) if getattr(module, "bias_hooked", False) else None
        if rows is not None:  # `surgery.set_bias_rows`' hook, which the file installs too
            changes.append({"path": path, "kind": "bias_rows", "rows": list(rows), "argument": module.bias_argument})
        if len(module._forward_pre_hooks) - (rows is not None) != len(reference._forward_pre_hooks) or \
                len(module._forward_hooks) != len(reference._forward_hooks):
            log.info("%s: a forward hook of pruning", path)
            return None
        if isinstance(module, sublayers.RemovedSublayer):
            changes.append({"path": path, "kind": "removed", "hidden": int(module.update.shape[0]),
                            "pair": module.pair, "full": module.full})
            continue
        if isinstance(module, sublayers.EmptyCore):
            changes.append({"path": path, "kind": "empty", "pair": module.pair})
            continue
        if type(module) is not type(reference):
            log.info("%s: %s where the config builds %s", path, type(module).__name__, type(reference).__name__)
            return None
        if isinstance(module, nn.Linear):
            if module.weight.shape != reference.weight.shape or (module.bias is None) != (reference.bias is None):
                changes.append({"path": path, "kind": "linear", "in": module.in_features,
                                "out": module.out_features, "bias": module.bias is not None})
            continue
        own = dict(reference.named_parameters(recurse=False))
        if set(own) != {n for n, _ in module.named_parameters(recurse=False)}:
            log.info("%s: a %s with other parameters", path, type(module).__name__)
            return None
        # parameters resized in a module of another kind (GPT-2's Conv1D, Swin's relative-position bias table)
        shapes = {n: list(p.shape) for n, p in module.named_parameters(recurse=False) if p.shape != own[n].shape}
        if shapes:
            changes.append({"path": path, "kind": "parameters", "shapes": shapes})
        # a PreTrainedModel's own attributes (its config, name_or_path) are what loading sets
        differing = ({} if isinstance(module, PreTrainedModel)
                     else _differing_attributes(path, module, reference, pruned.config))
        if differing is None:
            return None
        if differing:
            changes.append({"path": path, "kind": "attributes", "values": differing})
    # modules the pruned model dropped outside a replaced one (StableLM 2's per-head norms of removed heads): the
    # file makes no such change, and a model it built would hold them, initialised anew
    kept = {p for p, _ in pruned.named_modules()}
    replaced = [c["path"] for c in changes if c["kind"] in ("removed", "empty")]
    gone = [p for p in dense_modules if p not in kept and not any(p.startswith(r + ".") for r in replaced)]
    if gone:
        log.info("%s: in the model its config builds, not in the pruned one", gone[0])
        return None
    return changes


def _differing_attributes(path: str, module: nn.Module, reference: nn.Module, config: Any) -> dict[str, Any] | None:
    """The plain attributes (numbers, flags) of submodule `module` that differ from `reference`'s; None where
    something the file cannot set differs: an attribute of another type, one added or gone, a config other than
    the model's `config`."""
    from transformers import PretrainedConfig

    ours, theirs = _attributes(module), _attributes(reference)
    differing = {}
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key, _MISSING), theirs.get(key, _MISSING)
        if isinstance(a, PretrainedConfig) and isinstance(b, PretrainedConfig):
            if a is not config:
                log.info("%s: a config of its own (per-layer widths read from a config)", path)
                return None
            continue
        if not isinstance(a, _PLAIN) and not isinstance(b, _PLAIN):
            if type(a) is not type(b):  # e.g. a config view with the layer's own head count
                log.info("%s: attribute %s is a %s, not a %s", path, key, type(a).__name__, type(b).__name__)
                return None
            continue  # tensors, functions, modules: what the weights or the class carry
        if a == b:
            continue
        if type(a) not in _ATTRIBUTE_TYPES or type(b) not in _ATTRIBUTE_TYPES:
            log.info("%s: attribute %s changed in a way the file cannot set (%r, was %r)", path, key, a, b)
            return None
        differing[key] = a
    return differing


def auto_class(architecture: str) -> str:
    """The Auto class that loads a model class named `architecture`."""
    return next((auto for ending, auto in AUTO_CLASSES if architecture.endswith(ending)), "AutoModel")


def source(base: str, inner: tuple[str, str] | None = None) -> str:
    """modeling_osscar.py for a pruned model of transformers class `base`; `inner`: (the transformers class of the
    base model a task model wraps, its prefix), whose class is then written too."""
    stand_ins = "\n\n".join(inspect.getsource(obj) for obj in
                            (sublayers._first_tensor, sublayers.RemovedSublayer, sublayers.EmptyCore))
    text = (_HEADER.format(base=base, changes=CHANGES) + stand_ins
            + _FOOTER.format(cls=f"Osscar{base}", changes=CHANGES))
    if inner is not None:
        text += _BASE_CLASS.format(base=inner[0], cls=f"Osscar{inner[0]}", prefix=inner[1], changes=CHANGES)
    return text


def _inner(model: nn.Module) -> tuple[str, str] | None:
    """(the transformers class of the base model a task model wraps, its attribute) for AutoModel, or None."""
    import transformers

    prefix = getattr(model, "base_model_prefix", "")
    inner = getattr(model, prefix, None) if prefix else None
    if not isinstance(inner, nn.Module) or inner is model:
        return None
    name = type(inner).__name__
    return (name, prefix) if getattr(transformers, name, None) is type(inner) else None


def write_remote_code(model: nn.Module, directory: str | Path) -> bool:
    """Make a saved pruned model directory (config.json naming `type(model)`) load with transformers'
    `trust_remote_code=True`: modeling_osscar.py, config.json's `auto_map` and `osscar_changes`. Returns whether
    it did (False, with the reason logged, where a change is of a kind the file cannot make)."""
    import transformers

    directory = Path(directory)
    base = type(model).__name__
    if getattr(transformers, base, None) is not type(model):
        log.info("%s is not a transformers class: no remote code", base)
        return False
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        dense = type(model)._from_config(config)
    changes = module_changes(model, dense)
    if changes is None:
        return False
    inner = _inner(model)
    (directory / f"{MODULE}.py").write_text(source(base, inner))
    config_path = directory / "config.json"
    saved = json.loads(config_path.read_text())
    # AutoModel loads the base model alone, as from the dense checkpoint
    saved["auto_map"] = {**({"AutoModel": f"{MODULE}.Osscar{inner[0]}"} if inner else {}),
                         auto_class(base): f"{MODULE}.Osscar{base}"}
    saved[CHANGES] = changes
    write_config(config_path, saved)
    return True
