"""The compression request: one dataclass is the schema of every compress option.

Each field carries its help text (and CLI details) in its metadata, so the `osscar compress` flags
(`service.client.cli`), the protobuf conversion (`service.api.wire`) and the server's validation all come from here:
a new option is a field here plus its proto field. Fields that deliberately do not travel on the wire are
listed in `LOCAL_ONLY`; a test keeps the proto and this class in step.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compressor.calibration import IMAGENET_MEAN, IMAGENET_STD
from compressor.errors import InputError
from compressor.solver import METHODS
from compressor.solver.solve import NO_REFIT_METHODS
from compressor.transformer.pipeline import GQA_UNITS, UNCOMPENSATED
from exporters.runtime import PROVIDERS

from ..files import default_home, touches
from .budgets import default_budgets_text

# "exact" only solves single small layers; wanda-sp and flap are the retraining-free LLM baselines
PRUNING_METHODS = ("mp", "mp+", "thinet", "osscar", "wanda-sp", "flap")
DEFAULT_METHOD = "osscar"  # what a request that names no method runs
MAX_TIME_BUDGET_S = 7 * 86400  # the longest time budget a server accepts (a week)
MAX_MEASURED_ELEMENTS = 1 << 22  # batch x sequence of the measured shape (4M tokens)
SHAPE_KEYS = ("batch", "sequence")

# Text calibration defaults by attention kind (CompressRequest.text_calibration). An encoder's token
# attends to its whole window, so the number of windows, not of tokens, bounds how many contexts the
# statistics see. all-MiniLM-L6-v2, embedding cosine after pruning (bench/RESULTS.md, 2026-11-25): at
# 0.25, 0.883 from 128 windows of 128 tokens, 0.917 from 512 of 128 (4x the tokens), 0.922 from 512 of
# 16-128; at 0.5, 0.794 from 512 windows of 16-128 and 0.811 from 1,024 (36 s of pruning against 22 s). Its
# 1.5x target job (2026-11-27, WikiText-2 cosine): 0.906 from 1,024 windows (388 s), 0.918 from 2,048 (737 s,
# the same machine and hour), 0.915 from 2,048 whose planning passes read 1,024 (548 s; kinds.PLANNING_SEQUENCES).
# A decoder's causal window of n tokens already holds the contexts 1..n.
ENCODER_SEQUENCES, ENCODER_MIN_LENGTH = 2048, 16
DECODER_SEQUENCES = 128


@dataclass(frozen=True)
class TextCalibration:
    """A text calibration draw: `sequences` windows of `min_length` to `length` tokens."""

    sequences: int
    min_length: int
    length: int


# Request fields that never travel on the wire, and why:
LOCAL_ONLY = {
    "out_dir": "the server writes into a scratch directory and publishes artifacts",
    "device": "the server gives each job a device slot",
    "home": "the server's own $OSSCAR_HOME",
    "trust_remote_code": "granted per model directory by the server's policy, never by the request",
    "normalise": "a research knob of the target mode (bench/research.py); jobs use the default",
    "time_budget": "the submission's time_budget (CompressRequest.time_budget on the wire), which the supervisor "
                   "also enforces",
}
# The exactly-one-of group of the run mode (a proto oneof, a required mutually exclusive CLI group).
MODES = ("target_speedup", "uniform_ratio", "widths_from")
# Fields that name a model or data file (resolved by the server, uploaded by the client) -> what they
# name, in messages
REFERENCES = {"model": "model", "calibration": "calibration data", "eval": "evaluation data",
              "widths_from": "report"}


# What a job is (`ModelJob.traits`, plus TARGET in target mode) that an option may need: the options that need a
# trait the job lacks are named in one warning (`ignored_options`) instead of passing unnoticed
IMAGES, NPZ_IMAGES, TEXT, TRANSFORMER, TARGET = "images", "npz images", "text", "transformer", "target"
TRAIT_WORDS = {IMAGES: "for image models", NPZ_IMAGES: "for .npz images; .npy images are used as given",
               TEXT: "for text models", TRANSFORMER: "for transformers", TARGET: "in target mode only"}


def option(default: Any = None, help: str = "", *, factory: typing.Callable[[], Any] | None = None,
           choices: tuple[str, ...] | None = None, metavar: str | None = None, cli: bool = True,
           statistics: bool = False, needs: tuple[str, ...] = ()) -> Any:
    """A request field with its documentation (`help`, shown by `osscar compress -h`). `statistics`: the
    field changes the dense statistics, or the loss curves made of them (it keys their cache,
    `statistics_fields`). `needs`: the job traits (IMAGES, TEXT, TRANSFORMER, TARGET) without which the field
    changes nothing (the first one missing is named)."""
    assert set(needs) <= set(TRAIT_WORDS), needs
    metadata = {"help": help, "choices": choices, "metavar": metavar, "cli": cli, "statistics": statistics,
                "needs": needs}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class CompressRequest:
    model: str = option(help="a .pt2 torch.export program, a Hugging Face model directory or cached hub id, or "
                        "torchvision:<name>", statistics=True)
    calibration: Path = option(help="images: .npz with x uint8 NHWC, or .npy float32 NCHW used as-is; text "
                               "(transformers): .txt/.jsonl through the model's tokenizer, or token ids as .npz "
                               "(ids, offsets) / .npy", statistics=True)
    out_dir: Path = option(help="output directory", metavar="OUT")
    target_speedup: float | None = option(help="measured speedup to reach in ONNX Runtime (e.g. 1.5)")
    uniform_ratio: float | None = option(help="fraction of each prunable layer's groups removed (rounded, >= 1 "
                                         "kept): the paper's protocol, one round")
    widths_from: Path | None = option(help="the per-layer widths of an earlier report.json (e.g. to compare "
                                      "methods at equal widths)")
    eval: Path | None = option(help="evaluation data: images .npz with labels y (top-1; at most 512 MiB of them as "
                               "float32, a seeded draw beyond), token ids / text "
                               "(perplexity for LMs); default: inputs held out of the calibration data, never "
                               "calibrated on (top-1 agreement with the dense model for classifiers, cosine to "
                               "the dense outputs, perplexity); without it the calibration keeps what is not "
                               "held out, so it changes the statistics", statistics=True)
    # the curves' losses are each method's own (mp's support, osscar's; centring and the norms' scale follow it)
    method: str = option(DEFAULT_METHOD, "layer solver", choices=PRUNING_METHODS, statistics=True)
    samples: int | None = option(help="calibration images drawn (seeded); default: every image the file gives "
                                 "(less the held-out ones) up to 256 MiB of float32 images, and at least 500",
                                 statistics=True, needs=(IMAGES,))
    seed: int = option(0, "seed of the calibration draw", statistics=True)
    mean: tuple[float, ...] | None = option(help="per-channel mean for .npz images, after scaling to [0, 1]; "
                                            "default: the model directory's preprocessor_config.json image_mean, "
                                            f"else ImageNet's {IMAGENET_MEAN}", statistics=True,
                                            needs=(IMAGES, NPZ_IMAGES))
    std: tuple[float, ...] | None = option(help="per-channel std for .npz images; default: the model directory's "
                                           f"preprocessor_config.json image_std, else ImageNet's {IMAGENET_STD}",
                                           statistics=True, needs=(IMAGES, NPZ_IMAGES))
    device: str | None = option(help="pruning device: cuda or cpu (default: cuda when available)")
    batch_size: int = option(100, "calibration batch size (images)", needs=(IMAGES,))
    sequences: int | None = option(help="text calibration: windows drawn (seeded); default: 2048 for encoders, "
                                   "128 for decoders", statistics=True, needs=(TEXT,))
    sequence_length: int = option(128, "text calibration: tokens per window (the longest window)", statistics=True,
                                  needs=(TEXT,))
    min_sequence_length: int | None = option(help="text calibration: the shortest window; window lengths are drawn "
                                             "log-uniformly from it to --sequence-length; default: 16 for encoders "
                                             "(each window is one context of bidirectional attention), "
                                             "--sequence-length for decoders (a causal window holds every shorter "
                                             "context)", statistics=True, needs=(TEXT,))
    stream: bool = option(False, "transformers: read one block at a time from the safetensors shards and write it "
                          "back pruned (memory bounded by a block, for models larger than RAM); on by itself when "
                          "pruning in memory would take more than half of the available memory", needs=(TRANSFORMER,))
    activation_dtype: str = option("float32", "transformers: dtype of the calibration activations kept on the "
                                   "CPU between blocks", choices=("float32", "float16"), statistics=True,
                                   needs=(TRANSFORMER,))
    shape: dict[str, int] = option(help="measured input shape: batch=N[,sequence=N] (defaults: CNN images batch=64, "
                                   "vision transformers batch=8; encoders batch=8,sequence=128; decoders "
                                   "batch=1,sequence=512; a text model's sequence capped at its positions)",
                                   factory=dict,
                                   statistics=True)
    execution_provider: str | None = option(help="ONNX Runtime provider for measurement (default: cuda when "
                                            "available)", choices=PROVIDERS)
    threads: int | None = option(help="ONNX Runtime intra-op threads (default: the cores available)")
    deployment_target: str | None = option(help="where the model will be served; a warning when measurement runs "
                                           "elsewhere", choices=PROVIDERS)
    round_to: int | None = option(help="kept widths are multiples of this (or the full width); target mode: 8 when "
                                  "not given; uniform mode: widths are rounded only when given (a Mixture-of-Experts "
                                  "layer's experts keep multiples of 8 always)", statistics=True)
    min_width: float = option(0.1, "target mode: no layer keeps less than this fraction of its groups", statistics=True,
                              needs=(TARGET,))
    max_rounds: int = option(4, "target mode: prune -> measure rounds at most", needs=(TARGET,))
    latency_probes: int = option(4, "target mode: latency probes per round at most: the planned widths with "
                                 "sliced, unsolved weights, exported and measured (never evaluated), to find "
                                 "widths that meet the target before a round pays for its solve; 0: off",
                                 needs=(TARGET,))
    accuracy_budget: float | None = option(help="maximum relative drop of the metric (e.g. 0.02; a perplexity's "
                                           "relative rise, so 1 allows 2x dense), or none; "
                                           f"default: {default_budgets_text()}", metavar="D|none")
    no_accuracy_budget: bool = option(False, "no accuracy budget, not even the default one (--accuracy-budget none)",
                                      cli=False)
    back_off: bool = option(False, "return the largest measured speedup within the accuracy budget (the default "
                            "one too)", needs=(TARGET,))
    repeats: int = option(20, "latency samples per model (median and p90); fewer, at least 5, once a "
                         "model's samples have taken a minute (exporters.runtime.TIMING_SECONDS)")
    opset: int = option(18, "ONNX opset of the exports")
    precision: str = option("fp32", "compute precision of the exports, dense baseline included; inputs and outputs "
                            "stay float32", choices=("fp32", "fp16"))
    decode_step: bool = option(False, "causal LMs: also export decode.onnx, one token with past key/values per "
                               "layer")
    gqa: str = option("query-heads", "grouped-query attention: prune single query heads (a KV head goes when no "
                      "kept query head reads it) or whole KV groups", choices=GQA_UNITS, statistics=True,
                      needs=(TRANSFORMER,))
    refine_steps: int | None = option(help="reconstruction after the solves: Adam steps fitting the pruned weights "
                                      "to the dense model's outputs (transformers: per block, to the dense block's "
                                      "output; conv graphs: the whole graph, to the dense outputs); 0: off; default: "
                                      "for transformers each block's fit as long as its solves took (50 to 500 steps), "
                                      "300 for conv graphs (3,000 when whole blocks are removed), none with "
                                      "--method mp, wanda-sp or flap")
    remove_blocks: int | None = option(help="conv graphs: residual blocks with an identity shortcut removed whole "
                                       "before the channels are pruned, chosen one at a time by the least change "
                                       "of the outputs on calibration images; the reconstruction then fits the "
                                       "shallower graph to the dense one; 0: none; default: target mode chooses how "
                                       "many by weighing each block's measured latency and loss against the widths "
                                       "(report.json `depth`; transformers: whole layers), other modes remove none",
                                       statistics=True)
    add_bias: str = option("auto", "transformers: an output projection without a bias (Llama's) gets one for the "
                           "intercept of its refit: yes, no, or auto (as the method's paper does: flap only; FLAP's "
                           "compensation, which on a model with a few tokens of massive activation costs more than it "
                           "gains, bench/RESULTS.md)", choices=("auto", "yes", "no"), statistics=True,
                           needs=(TRANSFORMER,))
    normalise: str = option("stream", "target mode: layer losses relative to the residual stream they join, as the "
                            "change of the model's output they predict (transformers, `compressor.transformer."
                            "sensitivity`; conv graphs keep the stream; not the default: SmolLM2 and MiniLM "
                            "measured no better, bench/RESULTS.md), or relative to the layer's own output",
                            choices=("stream", "output", "layer"), cli=False, statistics=True, needs=(TARGET,))
    no_curves_cache: bool = option(False, "target mode: recompute the dense loss curves instead of reusing "
                                   "$OSSCAR_HOME/curves", needs=(TARGET,))
    home: Path | None = option(help="where caches live (default $OSSCAR_HOME, else ~/.osscar)", cli=False)
    # the job's time budget in seconds (the server's time_budget, the CLI's --time-budget): each round's
    # reconstruction is paced to fit what is left (`pacing`)
    time_budget: float | None = option(help="seconds the job may take", cli=False)
    trust_remote_code: bool = option(False, "run a Hugging Face model's own code", cli=False)

    @property
    def curves_cache(self) -> Path | None:
        """Where dense loss curves are cached (None: not cached)."""
        return None if self.no_curves_cache else (self.home or default_home()) / "curves"

    def reads(self, path: Path) -> bool:
        """Whether the job reads `path` (its model, calibration or evaluation data, or a file of its model's folder),
        or something inside it: what clearing a reused --out must leave (`compress out/model --out out`, or --out
        the model's own folder)."""
        return touches(path, (self.model, self.calibration, self.eval))

    def refine_steps_or(self, default: int) -> int:
        """The reconstruction steps in force: the request's, else the model kind's `default`; none for mp,
        and by default none for the methods that keep the dense weights (their papers fit nothing)."""
        if self.method == "mp":
            return 0
        if self.refine_steps is None:
            return 0 if self.method in NO_REFIT_METHODS else default
        return self.refine_steps

    def text_calibration(self, causal: bool) -> TextCalibration:
        """The text calibration draw in force for an encoder (`causal` False) or a decoder."""
        if causal:
            sequences, shortest = DECODER_SEQUENCES, self.sequence_length
        else:
            sequences, shortest = ENCODER_SEQUENCES, min(ENCODER_MIN_LENGTH, self.sequence_length)
        return TextCalibration(self.sequences or sequences, self.min_sequence_length or shortest,
                               self.sequence_length)

    def violations(self) -> list[tuple[str, str]]:
        """Every problem with the request as (field, message); the messages name the CLI flags."""
        errors: list[tuple[str, str]] = []

        def check(ok: bool, field: str, message: str) -> None:
            if not ok:
                errors.append((field, message))

        assert set(PRUNING_METHODS) <= set(METHODS)
        check(bool(self.model), "model", "a model is required")
        check(bool(self.calibration), "calibration", "calibration data is required (--calibration)")
        check(self.method in PRUNING_METHODS, "method",
              f"method must be one of {', '.join(PRUNING_METHODS)} (got {self.method!r})")
        check(sum(getattr(self, mode) is not None for mode in MODES) == 1,
              "target_speedup", "give exactly one of --target-speedup, --uniform-ratio and --widths-from")
        check(self.widths_from is None or _is_file(self.widths_from), "widths_from",
              f"--widths-from: no such report: {self.widths_from}")
        check(self.uniform_ratio is None or 0 < self.uniform_ratio < 1, "uniform_ratio",
              f"--uniform-ratio must be in (0, 1) (got {self.uniform_ratio})")
        check(self.target_speedup is None or (math.isfinite(self.target_speedup) and 1 < self.target_speedup <= 20),
              "target_speedup", f"--target-speedup must be in (1, 20] (got {self.target_speedup})")
        for name, low, high in (("samples", 1, 1_000_000), ("batch_size", 1, 100_000), ("sequences", 1, 1_000_000),
                                ("sequence_length", 2, 65536), ("max_rounds", 1, 20), ("latency_probes", 0, 20),
                                ("opset", 14, 23), ("repeats", 3, 10_000), ("remove_blocks", 0, 10_000)):
            value = getattr(self, name)
            check(value is None or low <= value <= high, name,
                  f"--{name.replace('_', '-')} must be in [{low}, {high}] (got {value})")
        check(self.min_sequence_length is None or 2 <= self.min_sequence_length <= self.sequence_length,
              "min_sequence_length", f"--min-sequence-length must be in [2, --sequence-length "
              f"{self.sequence_length}] (got {self.min_sequence_length})")
        check(self.round_to is None or 1 <= self.round_to <= 4096, "round_to",
              f"--round-to must be in [1, 4096] (got {self.round_to})")
        # the API's seed is an int32 (a seed the local CLI takes is one a server takes too), and the draws' generators
        # take no negative seed
        check(0 <= self.seed < 2**31, "seed", f"--seed must be in [0, 2^31 - 1] (got {self.seed})")
        for name, value in self._choices():
            allowed = _field(name).metadata["choices"]
            check(value in allowed, name, f"--{name.replace('_', '-')} must be one of {', '.join(allowed)} "
                                          f"(got {value!r})")
        bad = {k: v for k, v in self.shape.items() if k not in SHAPE_KEYS or not 1 <= v <= 65536}
        check(not bad, "shape", f"--shape takes batch=N and sequence=N with 1 <= N <= 65536 (got {bad})")
        tokens = self.shape.get("batch", 1) * self.shape.get("sequence", 1)
        check(bool(bad) or tokens <= MAX_MEASURED_ELEMENTS, "shape", f"--shape batch x sequence must be at most "
              f"{MAX_MEASURED_ELEMENTS} (got {tokens})")
        check(self.refine_steps is None or 0 <= self.refine_steps <= 100_000, "refine_steps",
              f"--refine-steps must be in [0, 100000] (got {self.refine_steps})")
        check(not (self.method == "mp" and self.refine_steps), "refine_steps",
              "--refine-steps does not apply to --method mp (magnitude pruning uses no calibration data)")
        check(not (self.add_bias == "yes" and self.method in UNCOMPENSATED), "add_bias",
              f"--add-bias yes needs a method that compensates (--method {self.method} keeps the kept weights as "
              "they are, so it has no intercept to put in a bias)")
        check(self.threads is None or 1 <= self.threads <= 1024, "threads",
              f"--threads must be in [1, 1024] (got {self.threads})")
        check(0 < self.min_width <= 1, "min_width", f"--min-width must be in (0, 1] (got {self.min_width})")
        check(not (self.target_speedup is not None and self.min_width == 1 and self.remove_blocks == 0),
              "min_width", "--min-width 1 with --remove-blocks 0 leaves target mode nothing to remove")
        check(self.device is None or re.fullmatch(r"cpu|cuda(:\d{1,2})?", self.device) is not None, "device",
              f"--device must be cpu, cuda or cuda:N (got {self.device!r})")
        check(self.time_budget is None or (math.isfinite(self.time_budget) and self.time_budget > 0), "time_budget",
              f"--time-budget must be a positive number of seconds (got {self.time_budget})")
        # a relative rise of a perplexity may exceed 1 (1: the default 2x dense rule); an accuracy's drop beyond 1
        # allows anything, as none does
        check(self.accuracy_budget is None or (math.isfinite(self.accuracy_budget) and self.accuracy_budget > 0),
              "accuracy_budget", f"--accuracy-budget must be a positive number (got {self.accuracy_budget})")
        check(not (self.no_accuracy_budget and self.accuracy_budget is not None), "accuracy_budget",
              f"--accuracy-budget is either a number or none (got {self.accuracy_budget} and none)")
        check(not (self.back_off and self.no_accuracy_budget), "back_off",
              "--back-off needs an accuracy budget (not --accuracy-budget none)")
        check(not (self.decode_step and self.precision != "fp32"), "decode_step",
              "--decode-step is exported in fp32 only")
        mean, std = self.mean or (), self.std or ()
        finite = all(math.isfinite(v) for v in (*mean, *std))
        check(len(mean) <= 16 and len(std) <= 16 and finite and all(v > 0 for v in std)
              and (not (mean and std) or len(mean) == len(std)),
              "std", "--mean and --std need the same number (at most 16) of finite values, std > 0")
        return errors

    def _choices(self) -> list[tuple[str, Any]]:
        """(field, value) of every set field whose values are a fixed list."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.metadata.get("choices") and getattr(self, f.name) is not None]

    def ignored_options(self, traits: typing.AbstractSet[str]) -> list[str]:
        """The options set away from their defaults that change nothing for a job with `traits` (`ModelJob.traits`;
        TARGET is added here in target mode), each as "--flag (for ...)"."""
        traits = set(traits) | ({TARGET} if self.target_speedup is not None else set())
        ignored = []
        for f in dataclasses.fields(self):
            missing = [need for need in f.metadata["needs"] if need not in traits]
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            if missing and getattr(self, f.name) != default:
                ignored.append(f"--{f.name.replace('_', '-')} ({TRAIT_WORDS[missing[0]]})")
        return ignored

    def validate(self) -> None:
        errors = self.violations()
        if errors:
            raise InputError("; ".join(message for _, message in errors))


def _field(name: str) -> dataclasses.Field:
    return {f.name: f for f in dataclasses.fields(CompressRequest)}[name]


def statistics_fields() -> tuple[str, ...]:
    """The fields declared with `statistics=True`: what the dense loss curves depend on."""
    return tuple(f.name for f in dataclasses.fields(CompressRequest) if f.metadata.get("statistics"))


def field_types() -> dict[str, Any]:
    """Each field's type with `| None` removed (Path, float, tuple[float, ...], ...)."""
    hints = typing.get_type_hints(CompressRequest)
    out = {}
    for name, hint in hints.items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        out[name] = args[0] if isinstance(hint, types.UnionType) and len(args) == 1 else hint
    return out


def request_from_spec(spec: dict[str, Any], **local: Any) -> CompressRequest:
    """A request from plain values (JSON from the wire or the store; references already resolved to paths)
    plus the local-only fields (`out_dir`, `device`, ...). Values take their field's type; unknown names are
    a bug of the caller and raise TypeError."""
    types = field_types()
    values: dict[str, Any] = {}
    for name, value in {**spec, **local}.items():
        if name not in types:
            raise TypeError(f"CompressRequest has no field {name!r}")
        kind = typing.get_origin(types[name]) or types[name]
        if value is None or kind in (str, bool, int, float):
            values[name] = value
        elif kind is Path:
            values[name] = Path(value)
        elif kind is tuple:
            values[name] = tuple(float(v) for v in value)
        elif kind is dict:
            values[name] = {str(k): int(v) for k, v in dict(value).items()}
        else:
            raise TypeError(f"no conversion for field {name!r} of type {types[name]}")
    return CompressRequest(**values)


def _is_file(path: str | Path) -> bool:
    try:
        return Path(path).is_file()
    except (OSError, ValueError):  # a name too long for the filesystem, a NUL byte
        return False
