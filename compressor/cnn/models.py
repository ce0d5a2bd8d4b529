"""Graph models (CNNs): resolving a reference to an ATen graph, and saving pruned programs.

Accepted references:
  * a `torch.export` program file (`.pt2`);
  * a Hugging Face model directory, or a hub id already in the local cache (never downloaded;
    `trust_remote_code` stays off unless the caller enables it);
  * `torchvision:<name>` where torchvision imports (it does not next to the CPU torch wheel).
Everything else is refused with what was expected: unknown schemes, missing files, and pickles that
`torch.load(weights_only=True)` cannot load (they could run code).

Whatever the source, the model is brought to torch.export's ATen graph (a GraphModule), the one
representation the analysis and surgery work on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import fx

from ..errors import ModelReferenceError, UnsupportedArchitecture
from .graph import DROPOUT_OPS

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = {".pt", ".pth", ".bin", ".ckpt", ".pkl"}


@dataclass
class LoadedModel:
    module: fx.GraphModule  # ATen graph, eval mode
    input_shape: tuple[int, ...]  # one sample's shape, e.g. (3, 32, 32)
    kind: str  # "pt2" | "hf" | "torchvision"
    input_name: str = "x"


def load_model(reference: str, *, trust_remote_code: bool = False, image_size: int | None = None) -> LoadedModel:
    """Resolve `reference` to a graph module (see the module docstring for what is accepted)."""
    ref = str(reference).strip()
    if not ref:
        raise ModelReferenceError("empty model reference")
    if ref.startswith("torchvision:"):
        return _load_torchvision(ref, image_size)
    scheme = ref.split(":", 1)[0] if ":" in ref and not Path(ref).exists() else ""
    if scheme and "/" not in scheme and len(scheme) > 1:
        raise ModelReferenceError(f"unknown model reference scheme {scheme!r} in {ref!r}; expected a .pt2 file, "
                                  "a Hugging Face model directory or cached hub id, or torchvision:<name>")
    path = Path(ref).expanduser()
    if path.suffix == ".pt2":
        if not path.is_file():
            raise ModelReferenceError(f"no such torch.export program: {path}")
        return _load_pt2(path, ref)
    if path.suffix in PICKLE_SUFFIXES:
        _refuse_pickle(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelReferenceError(f"{path} is a directory without config.json; expected a Hugging Face model "
                                      "directory")
        return _load_hf(str(path), ref, trust_remote_code, image_size)
    if path.exists():
        raise ModelReferenceError(f"{path}: unsupported file type {path.suffix!r}; expected a .pt2 torch.export "
                                  "program or a Hugging Face model directory")
    if ref.count("/") == 1 and not ref.startswith((".", "/", "~")):
        return _load_hf(ref, ref, trust_remote_code, image_size)  # a hub id: local cache only
    raise ModelReferenceError(f"no such file or directory: {ref}")


def _refuse_pickled_constants(path: Path) -> None:
    """A .pt2 is a zip; members that torch.export.load would unpickle freely could run code on load."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as err:
        raise ModelReferenceError(f"{path} is not a loadable torch.export program: {err}") from err
    pickled = sorted(n for n in names if n.rsplit("/", 1)[-1].startswith(_PICKLED_CONSTANTS))
    if pickled:
        raise ModelReferenceError(f"{path} holds pickled objects ({', '.join(pickled[:3])}"
                                  f"{', ...' if len(pickled) > 3 else ''}), which could run code when loaded; "
                                  "export the model without script objects or opaque constants")


@contextlib.contextmanager
def _weights_only_loads() -> Iterator[None]:
    """Every `torch.load` inside the block is weights_only, even where torch.export.load asks for a full unpickle
    (its fallback for a sample input or a constant that weights_only refuses, which could run code)."""
    key = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _input_shape(gm: fx.GraphModule) -> tuple[int, ...]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise ModelReferenceError(f"expected a model with one input tensor, found {len(placeholders)} inputs")
    val = placeholders[0].meta.get("val")
    if val is None or val.dim() < 2:
        raise ModelReferenceError("the program records no input shape")
    if isinstance(val.shape[0], int):  # the program's guards then refuse every other batch (calibration, export)
        raise ModelReferenceError(
            f"the program's batch dimension is fixed at {val.shape[0]}: export it with a dynamic batch, "
            "torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim.DYNAMIC},)), with x of batch 2 "
            "or more")
    shape = []
    for s in val.shape[1:]:
        if not isinstance(s, int):
            raise ModelReferenceError("only the batch dimension of the input may be dynamic")
        shape.append(int(s))
    return tuple(shape)


# members of a .pt2 archive that torch.export.load unpickles with no restriction (`pickle.loads`, TorchScript's
# unpickler): script objects and opaque constants, which no program of a CNN holds
_PICKLED_CONSTANTS = ("custom_obj_", "opaque_obj_")


def _load_pt2(path: Path, ref: str) -> LoadedModel:
    _refuse_pickled_constants(path)
    try:
        with _weights_only_loads():
            program = torch.export.load(str(path))
    except Exception as err:  # a corrupt or foreign file: say what it is, not a traceback
        raise ModelReferenceError(f"{path} is not a loadable torch.export program: {err}") from err
    gm = program.module()
    to_inference_mode(gm, ref)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return LoadedModel(gm, _input_shape(gm), "pt2", placeholders[0] if placeholders else "x")


def _is_batch_counter(node: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr" and str(node.target).endswith("num_batches_tracked")


# (op, index of its training flag): an exported graph holds its mode as a constant, which `.eval()` cannot change
# (every dropout's is its third argument: input, p, train)
_TRAINING_FLAGS = {torch.ops.aten.batch_norm.default: 5, **dict.fromkeys(DROPOUT_OPS, 2)}


def to_inference_mode(gm: fx.GraphModule, ref: str = "the program") -> int:
    """Set the training flags of a program exported in training mode to False, in place: its BatchNorms would
    normalise by each batch's statistics (and move their running statistics at every calibration pass), its
    dropouts drop at random. Returns how many it changed (logged: a user should export in eval mode)."""
    changed = 0
    for node in list(gm.graph.nodes):
        index = _TRAINING_FLAGS.get(node.target)
        # a BatchNorm without running statistics (track_running_stats=False) normalises by the batch's in eval mode
        # too: its flag is what eval mode runs, not a training export's
        no_statistics = node.target == torch.ops.aten.batch_norm.default and len(node.args) > 3 and node.args[3] is None
        if index is not None and len(node.args) > index and node.args[index] is True and not no_statistics:
            node.args = (*node.args[:index], False, *node.args[index + 1:])
            changed += 1
        elif node.target == torch.ops.aten.add_.Tensor and not node.users and _is_batch_counter(node.args[0]):
            gm.graph.erase_node(node)  # a training BatchNorm's num_batches_tracked += 1
    if changed:
        gm.recompile()
        log.warning("%s was exported in training mode: %d BatchNorm/dropout ops set to inference (export it after "
                    "model.eval())", ref, changed)
    return changed


def _refuse_pickle(path: Path) -> None:
    if not path.is_file():
        raise ModelReferenceError(f"no such file: {path}")
    try:
        obj = torch.load(str(path), weights_only=True, map_location="cpu")
    except Exception as err:
        raise ModelReferenceError(f"{path} is a pickle that weights_only loading refuses (it may run code); "
                                  "export the model with torch.export and pass the .pt2") from err
    raise ModelReferenceError(f"{path} holds {type(obj).__name__} weights without an architecture; pass a "
                              ".pt2 torch.export program or a Hugging Face model directory")


def _export(module: torch.nn.Module, example: torch.Tensor) -> torch.export.ExportedProgram:
    """torch.export with a dynamic batch dimension (the one input's first)."""
    batch = torch.export.Dim.DYNAMIC
    with torch.no_grad():
        return torch.export.export(module, (example,), dynamic_shapes=({0: batch},), strict=False)


def export_module(module: torch.nn.Module, example: torch.Tensor) -> fx.GraphModule:
    """torch.export an eager module (dynamic batch) and return its ATen graph module."""
    return _export(module.eval(), example).module()


def _load_hf(location: str, ref: str, trust_remote_code: bool, image_size: int | None) -> LoadedModel:
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(location, local_files_only=True,
                                                         trust_remote_code=trust_remote_code)
    except OSError as err:
        raise ModelReferenceError(f"{ref!r} is neither a local model directory nor a model in the local Hugging "
                                  f"Face cache (nothing is downloaded): {err}") from err
    if not hasattr(config, "num_channels"):
        raise UnsupportedArchitecture(f"{ref}: {config.model_type!r} is not an image model; transformer models are "
                                      "pruned by the transformer adapters")
    # safetensors only: a pickled pytorch_model.bin can run code when loaded
    model = transformers.AutoModelForImageClassification.from_pretrained(
        location, local_files_only=True, trust_remote_code=trust_remote_code, use_safetensors=True)
    size = image_size or int(getattr(config, "image_size", 224) or 224)

    class Logits(torch.nn.Module):  # the first output (logits) as a plain tensor
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return self.inner(pixel_values=pixel_values).logits

    example = torch.zeros(2, config.num_channels, size, size)
    gm = export_module(Logits(model), example)
    return LoadedModel(gm, (config.num_channels, size, size), "hf", "pixel_values")


def _load_torchvision(ref: str, image_size: int | None) -> LoadedModel:
    name = ref.split(":", 1)[1]
    try:
        import torchvision
    except Exception as err:  # ImportError, or its C++ ops failing next to a CPU-only torch
        raise ModelReferenceError(f"{ref}: torchvision does not import on this machine ({err}); pass a .pt2 "
                                  "torch.export program instead") from err
    try:
        model = torchvision.models.get_model(name, weights=None)
    except ValueError as err:
        raise ModelReferenceError(f"{ref}: unknown torchvision model {name!r}") from err
    size = image_size or 224
    return LoadedModel(export_module(model, torch.zeros(2, 3, size, size)), (3, size, size), "torchvision")


def _own_storage(module: torch.nn.Module) -> None:
    """Every parameter and buffer of `module` as a contiguous tensor owning its storage (values unchanged).
    Surgery leaves views (a consumer's columns of one solved matrix); torch.export.save stores such a
    tensor as a slice of a storage it cannot find whole and warns ("No complete tensor found in the
    group! Returning the first one")."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and not _owns_storage(param):
                sub._parameters[name] = torch.nn.Parameter(param.detach().clone(memory_format=torch.contiguous_format),
                                                           requires_grad=param.requires_grad)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and not _owns_storage(buffer):
                sub._buffers[name] = buffer.detach().clone(memory_format=torch.contiguous_format)


def _owns_storage(tensor: torch.Tensor) -> bool:
    return tensor.is_contiguous() and tensor.storage_offset() == 0 and \
        tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def save_program(module: fx.GraphModule, path: str | Path, example: torch.Tensor) -> None:
    """Save a (pruned) graph module as a .pt2 program with a dynamic batch dimension."""
    example = example.detach().clone()  # a view would store its whole base tensor in the file
    _own_storage(module)
    torch.export.save(_export(module, example), str(path))
