"""What the stacks that serve an encoder read beside its ONNX, written into a job's pruned model directory.

- Optimum's `ORTModelFor...` (`from_pretrained(model_dir, subfolder="onnx")`): config.json (the model type,
  labels) in the directory, the graph as `onnx/model.onnx`, as the Hub's ONNX exports lay it out; for an image
  classifier (a CNN job: no pruned model directory) config.json beside the job's model.onnx.
- sentence-transformers (`SentenceTransformer(model_dir)`, and `backend="onnx"`, which reads
  `onnx/model.onnx` through Optimum): modules.json and what its modules keep in their folders (pooling,
  normalisation, a dense projection), copied from the source model unchanged: pruning removes heads and FFN
  neurons, never hidden channels, so the token embeddings they read keep their width.

The graph in `onnx/` is a hard link to the returned model.onnx where the file system allows (a copy
elsewhere); archives store it as a file of its own (`service.files.write_tar`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

ONNX_DIR = "onnx"  # the subfolder Optimum and sentence-transformers' ONNX backend read
MODULES = "modules.json"
# sentence-transformers' files of the model as a whole (the Transformer module's are the directory's own)
SENTENCE_FILES = (MODULES, "sentence_bert_config.json", "config_sentence_transformers.json")
# a Normalize module keeps nothing in its folder (often absent from a copy); sentence-transformers 6 names its classes
# `sentence_transformers.base.modules.normalize.Normalize` where 5 wrote `sentence_transformers.models.Normalize`
NORMALIZE = "Normalize"


def _module_class(module: dict) -> str:
    """A modules.json entry's class name, whichever package path the sentence-transformers release wrote."""
    return str(module.get("type", "")).rsplit(".", 1)[-1]

# a Hugging Face image classifier's files that Optimum (and transformers' pipelines) read beside its graph
IMAGE_CLASSIFIER_FILES = ("config.json", "preprocessor_config.json")


class LayoutError(ValueError):
    """A source model's sentence-transformers files that cannot be carried over."""


def link_onnx(onnx: Path, model_dir: Path) -> Path:
    """`model_dir/onnx/model.onnx` (and its external data files), the returned graph; returns its path."""
    target = Path(model_dir) / ONNX_DIR
    target.mkdir(parents=True, exist_ok=True)
    for path in [onnx, *sorted(onnx.parent.glob(f"{onnx.name}*.data"))]:
        dest = target / path.name
        dest.unlink(missing_ok=True)
        try:
            os.link(path, dest)
        except OSError:  # another file system, or one without hard links
            shutil.copyfile(path, dest)
    return target / onnx.name


def sentence_pooling(source: Path) -> str:
    """How a sentence-transformers model pools its token states into the embedding it serves: "cls", "max",
    "lasttoken" (a decoder's embedding: Qwen3-Embedding, gte-Qwen2, e5-mistral) or "mean" (also for a model that is
    none, and for the rarer modes, whose cosine mean pooling approximates). sentence-transformers 5 writes flags
    (`pooling_mode_cls_token`, ...), 6 one `pooling_mode`."""
    try:
        modules = sentence_modules(Path(source)) or []
    except LayoutError:
        return "mean"
    for module in modules:
        if _module_class(module) != "Pooling" or not isinstance(module.get("path"), str):
            continue
        try:
            config = json.loads((Path(source) / module["path"] / "config.json").read_text())
        except (OSError, ValueError):
            return "mean"
        if not isinstance(config, dict):
            return "mean"
        mode = config.get("pooling_mode")
        if mode in ("cls", "max", "lasttoken"):
            return mode
        if mode is None and config.get("pooling_mode_lasttoken") and not config.get("pooling_mode_mean_tokens"):
            return "lasttoken"
        if mode is None and config.get("pooling_mode_cls_token") and not config.get("pooling_mode_mean_tokens"):
            return "cls"
        if mode is None and config.get("pooling_mode_max_tokens") and not config.get("pooling_mode_mean_tokens"):
            return "max"
        return "mean"
    return "mean"


def copy_image_classifier_files(source: Path, out: Path) -> list[str]:
    """config.json (labels, model type) and the preprocessing of a Hugging Face image classifier, beside the
    job's model.onnx in `out`, so Optimum's ORTModelForImageClassification loads `out` as it is; returns the
    names copied. The config keeps the dense widths: Optimum reads its labels, never its widths."""
    copied = []
    for name in IMAGE_CLASSIFIER_FILES:
        if (Path(source) / name).is_file():
            if not (Path(out) / name).exists() or not (Path(out) / name).samefile(Path(source) / name):
                shutil.copyfile(Path(source) / name, Path(out) / name)  # --out the model's own folder: it is there
            copied.append(name)
    return copied


def sentence_modules(source: Path) -> list[dict] | None:
    """The source model's modules.json entries, None when it is not a sentence-transformers model."""
    path = Path(source) / MODULES
    if not path.is_file():
        return None
    try:
        modules = json.loads(path.read_text())
    except ValueError as err:
        raise LayoutError(f"{path} is not valid JSON") from err
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise LayoutError(f"{path}: expected a list of modules, each with its type")
    return modules


def copy_sentence_files(source: Path, model_dir: Path, hidden: int) -> bool:
    """Carry a sentence-transformers model's files over to its pruned directory; returns whether the source
    is one. `hidden`: the pruned model's hidden size, which a pooling module's config must read."""
    source, model_dir = Path(source), Path(model_dir)
    modules = sentence_modules(source)
    if modules is None:
        return False
    # every check before anything is copied: a refused layout leaves nothing of itself in model_dir
    bad = [str(m.get("path")) for m in modules
           if not isinstance(m.get("path", ""), str) or Path(m.get("path", "")).is_absolute()
           or ".." in Path(m.get("path", "")).parts]
    if bad:
        raise LayoutError(f"{source / MODULES}: module paths outside the model directory: {', '.join(bad)}")
    folders = [m.get("path", "") for m in modules if m.get("path", "")]  # "": the Transformer, model_dir itself
    for module in modules:
        path = module.get("path", "")
        if path and not (source / path).is_dir() and _module_class(module) != NORMALIZE:
            raise LayoutError(f"{source / MODULES}: module {module.get('name', path)!r} ({module['type']}) has no "
                              f"folder {path!r} in the source model")
        pooling = source / path / "config.json" if path and _module_class(module) == "Pooling" else None
        if pooling is not None and pooling.is_file():
            try:
                config = json.loads(pooling.read_text())
                # sentence-transformers 5 / 6
                width = config.get("word_embedding_dimension", config.get("embedding_dimension"))
            except (ValueError, AttributeError) as err:
                raise LayoutError(f"{pooling} is not a JSON object") from err
            if width is not None and width != hidden:
                raise LayoutError(f"{path}/config.json pools {width} channels, the model has {hidden}")
    for name in SENTENCE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, model_dir / name)
    for path in folders:
        if (source / path).is_dir():
            shutil.copytree(source / path, model_dir / path, dirs_exist_ok=True)
        else:  # a Normalize module: an empty folder
            (model_dir / path).mkdir(parents=True, exist_ok=True)
    log.info("%s: sentence-transformers modules %s carried over", model_dir,
             ", ".join(m.get("path") or "(transformer)" for m in modules))
    return True
