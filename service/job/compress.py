"""The compression job: resolve -> calibrate -> (curves -> allocate) -> prune -> export -> measure ->
adjust -> save, and the report.

Two modes: `uniform_ratio` (the paper's protocol: that fraction of every layer, one round) or
`widths_from` (the widths of an earlier report, one round), and `target_speedup` (widths from the dense
model's loss-versus-width curves and a latency model, then the closed loop of `targeting`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from compressor.errors import InputError
from compressor.layerstats import Widths, num_to_prune
from compressor.progress import WARNING, Progress, ProgressFn, note, warning
from compressor.reports import LayerReport, RefineReport
from exporters.fusion import fusion_of, unfused_path
from exporters.genai import CONFIG as GENAI_CONFIG
from exporters.onnx import ExportError, Parity, ParityError, stamp_metadata
from exporters.runtime import (
    PROVIDERS,
    Latency,
    RuntimeFailure,
    RuntimeKilled,
    default_provider,
    default_threads,
    measure_latency,
    no_visible_gpu,
)

from ..files import (
    JOB_EXPORTS,
    JOB_OUTPUTS,
    earlier_job_files,
    file_sha256,
    follow_umask,
    foreign_model,
    out_of_disk,
    write_text_atomically,
)
from .kinds import ConvJob, ModelJob, Say, Solved, open_job
from .pacing import Pace, StageClock
from .progress import render
from .report import Report
from .report_html import write_html
from .reporting import build_report, evaluation_failed_report, parity_failed_report, version
from .request import CompressRequest
from .targeting import (
    MET,
    ROUND_TO,
    Measure,
    Round,
    Stage,
    check_gqa_of,
    choose,
    removed_of,
    run_target,
    widths_of,
)
from .timing import QuietTimer

log = logging.getLogger(__name__)

# what an export that torch.onnx cannot make, that does not match PyTorch, or that ONNX Runtime cannot run, raises
EXPORT_FAILURES = (ExportError, ParityError, RuntimeFailure)
# what a job writes into --out beside report.json; none of it may outlive a parity_failed job there
EXPORT_FILES = tuple(name for name in JOB_EXPORTS if name != "report.json")  # report.json: written after


class _ExportFailed(Exception):
    """An export of this job failed parity or ONNX Runtime: the job ends parity_failed."""

    def __init__(self, stage: str, index: int | None, error: Exception, layers: list[LayerReport] | None = None):
        super().__init__(str(error))
        self.stage, self.index, self.error, self.layers = stage, index, error, layers or []


class _EvaluationFailed(Exception):
    """The job cannot vouch for its accuracy check (it would score something other than the returned
    model on unseen inputs): the job ends evaluation_failed, never with a made-up metric."""

    def __init__(self, stage: str, index: int | None, detail: str, layers: list[LayerReport] | None = None):
        super().__init__(detail)
        self.stage, self.index, self.detail, self.layers = stage, index, detail, layers or []


class _OutOfTime(Exception):
    """The time budget left cannot hold another round (the longest one so far): the job stops its rounds and
    returns the best of those it has, instead of starting one that a server would kill with everything done."""

    def __init__(self, index: int, left: float, round_s: float):
        super().__init__(f"round {index} not started: {max(left, 0.0):.0f}s of the time budget left, and a round "
                         f"took up to {round_s:.0f}s")
        self.index = index


def _check_here(request: CompressRequest) -> None:
    """The request against this machine: its device and ONNX Runtime provider exist here, --out can be written,
    and an `--out/model` folder is an earlier job's (a job replaces it whole)."""
    import onnxruntime as ort

    device = request.device
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {device}: this torch has no CUDA device (torch {torch.__version__}); use cpu")
    if device is not None and device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise InputError(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices here")
    provider = request.execution_provider
    if provider is not None and PROVIDERS[provider] not in ort.get_available_providers():
        raise InputError(f"--execution-provider {provider}: ONNX Runtime here has only "
                         f"{', '.join(ort.get_available_providers())}")
    if provider == "cuda" and no_visible_gpu():  # a server's cpu slot: refused now, not after the whole prune
        raise InputError("--execution-provider cuda: no GPU is visible to this job (CUDA_VISIBLE_DEVICES is empty, "
                         "as in a server's cpu slot)")
    out = Path(request.out_dir)
    existing = next(p for p in (out, *out.parents) if p.exists() or p == Path(p.anchor) or str(p) == ".")
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"--out {out}: {existing} is {'not a folder' if not existing.is_dir() else 'not writable'}")
    if request.widths_from is not None:  # read now: a report that does not read was found after the dense export
        widths_of(request.widths_from)
        removed_of(request.widths_from)
        check_gqa_of(request.widths_from, request.gqa)
    model = out / "model"
    if not request.reads(model) and (why := foreign_model(out)):
        raise InputError(why)


def _identical(outputs: Any, reference: Any) -> bool:
    """Whether two models' evaluation outputs are the same to the bit (arrays, or lists and tuples of them)."""
    if isinstance(outputs, list | tuple) and isinstance(reference, list | tuple):
        return len(outputs) == len(reference) and all(_identical(a, b) for a, b in zip(outputs, reference, strict=True))
    return np.array_equal(np.asarray(outputs), np.asarray(reference))


def _finite(outputs: Any) -> bool:
    if isinstance(outputs, list | tuple):
        return all(_finite(o) for o in outputs)
    return bool(np.isfinite(np.asarray(outputs, dtype=np.float64)).all())


def _check_held_out(job: ModelJob) -> None:
    """The evaluation data must be unseen by the calibration and large enough to tell a broken model (the
    model kinds refuse smaller data as the caller's; this is the job's own last word before it scores)."""
    if not job.held_out.enough:
        raise _EvaluationFailed("baseline", None, f"too few held-out inputs to score ({job.held_out})")


def fit_torch_threads() -> int:
    """Torch's intra-op pool within the cores this process may use (`exporters.runtime.default_threads`: its
    affinity and its cgroup's CPU quota): torch sizes it by the host's cores, so a job in a container limited to 2 CPUs
    of 64 ran 64 threads of calibration and solves, throttled. Returns the pool's size."""
    cores = default_threads()
    if torch.get_num_threads() > cores:
        torch.set_num_threads(cores)
    return torch.get_num_threads()


def compress(request: CompressRequest, progress: ProgressFn | None = None,
             stage: Stage | None = None) -> Report:
    """Run the job; writes model.onnx, the pruned model, report.json and report.html into request.out_dir.
    Returns the report; its `status` says whether the target and the accuracy budget were met, or
    `parity_failed`: an export (the dense baseline's, a round's or the decode step's) did not match
    PyTorch or did not run in ONNX Runtime; then report.json, saying where and by how much, is all it writes.

    `progress` receives every progress record (`compressor.progress.Progress`: the pipelines', and the
    job's own lines as NOTE and WARNING records; `service.job.progress.render` words them); `stage(name,
    round)` each stage as it begins: loading, baseline, statistics, allocate, prune, measure, save (round:
    the prune-measure round, else 0)."""
    request.validate()
    if request.out_dir is None:
        raise InputError("an output directory is required (--out)")
    fit_torch_threads()
    _check_here(request)  # what can be known before the model loads, not found an hour into the job
    emit = progress or (lambda record: log.info("%s", render(record)))
    warnings: list[str] = []  # every warning of the job, also in report.json's `warnings`

    def say(line: str | Progress) -> None:
        record = line if isinstance(line, Progress) else note(line)
        # once each: target mode prunes several rounds, and a pipeline's warning comes back with every round
        if record.stage == WARNING and record.message not in warnings:
            warnings.append(record.message)
        emit(record)

    enter = StageClock(stage)  # times each stage, and forwards it to `stage`
    start = time.perf_counter()
    enter("loading", 0)
    job = open_job(request, say)
    if request.decode_step and not job.causal:
        raise InputError("--decode-step is for causal language models")
    ignored = request.ignored_options(job.traits)
    if ignored:  # a pipeline passing one set of flags to every model is served; its reader learns what did nothing
        say(warning(f"ignored, as this job has no use for them: {', '.join(ignored)}"))
    provider = request.execution_provider or default_provider()
    if request.deployment_target and request.deployment_target != provider:
        say(warning(f"measuring on {provider}, but the declared deployment target is {request.deployment_target}; "
            "the speedup may not transfer"))
    out = Path(request.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".osscar-work-", dir=out))
    rounds: list[Round] = []
    baseline_metric: float | None = None
    pace = Pace(request.time_budget, start=start)  # the budget counts from the job's start, loading included
    try:
        enter("baseline", 0)
        held = job.held_out
        say(f"accuracy check: {held.evaluation} unseen {'images' if held.tokens is None else 'windows'} "
            f"({held.source}{f', {held.tokens} tokens' if held.tokens is not None else ''}), "
            f"{held.calibration} for calibration"
            + (f"; the calibration gave up {held.taken_from_calibration} of its images to hold them out"
               if held.taken_from_calibration else "")
            + (f"; {held.overlap_dropped} identical to calibration inputs dropped" if held.overlap_dropped else ""))
        _check_held_out(job)
        say("exporting the dense model for the baseline")
        dense_onnx = work / "dense.onnx"
        try:
            job.export(job.dense, dense_onnx)
            reference = job.outputs(dense_onnx)
        except EXPORT_FAILURES as err:
            raise _ExportFailed("baseline", None, err) from err
        if not _finite(reference):
            raise _EvaluationFailed("baseline", None, "the dense model's outputs on the held-out inputs are not "
                                    "finite: no metric can be measured against them")
        baseline_metric = job.score(reference, reference)
        baseline_secondary = job.secondary(reference, reference)
        for text in job.baseline_warnings(reference):
            say(warning(text))
        feed = job.latency_feed()
        timer = QuietTimer(dense_onnx, feed, provider, request.threads, request.repeats, say)

        pieced: list[str] = []  # why the graphs ran in pieces, once said

        def export_and_time(module: nn.Module, path: Path) -> tuple[Parity, Latency]:
            """Export (parity-checked) and time against the dense export: a round's or a probe's model."""
            parity = job.export(module, path)
            latency = timer(path)
            if latency.in_turn:
                say(warning(f"timed the dense and the compressed model one at a time ({latency.in_turn}): a change "
                            "of the host's speed between turns is not cancelled as in paired timing, so the measured "
                            "speedup is less certain (a few percent on a busy host)"))
            if latency.in_pieces and not pieced:
                pieced.append(latency.in_pieces)
                say(warning(f"ONNX Runtime ran each graph in pieces ({latency.in_pieces}): a latency is the sum of "
                            "its pieces', each timed beside the other graph's piece of the same index; a graph whose "
                            "one session the host cannot hold is checked and evaluated in pieces too"))
            return parity, latency

        # each finished round's wall time, from its first latency probe after the first round: what the next one is
        # expected to take (the first round's: its solve on; depth planning and trials before it are no round's)
        round_seconds: list[float] = []
        began: list[float] = []  # when the next round's first probe began, once a round has finished

        def begin(index: int) -> None:
            """A measurement after a finished round, the first of the next round: not started when the time left
            cannot hold a round (its probes ran past the budget before the round was then not started)."""
            if not rounds or began:
                return
            left = pace.left()
            if round_seconds and left is not None and left < max(round_seconds):
                raise _OutOfTime(index, left, max(round_seconds))
            began.append(time.perf_counter())

        def run_round(plan: Widths, index: int, predicted: float | None = None, solved: Solved | None = None
                      ) -> Round:
            begin(index)
            started = began.pop() if began else time.perf_counter()
            done = _run_round(plan, index, predicted, solved)
            round_seconds.append(time.perf_counter() - started)
            return done

        def _run_round(plan: Widths, index: int, predicted: float | None, solved: Solved | None) -> Round:
            enter("prune", index)
            fit_seconds = pace.fit_seconds(index)
            if fit_seconds == 0 and request.refine_steps_or(1):  # a job that fits at all (not mp, wanda-sp, flap)
                say(warning(f"round {index}: the time budget has no time left for the reconstruction; the round's "
                            "solves go unfitted (a larger --time-budget fits them)"))
            module, layers = job.prune(plan, fit_seconds=fit_seconds, solved=solved, fit_deadline=pace.end())
            enter("measure", index)
            # one folder per round: the file keeps its final name, so the external data it references over
            # 2 GB (model.onnx.data) stays valid when moved
            path = work / f"round{index}" / "model.onnx"
            path.parent.mkdir()
            say(f"round {index}: exporting and measuring in ONNX Runtime ({provider})")
            try:
                parity, latency = export_and_time(module, path)
                scored = file_sha256(path)  # what _save checks it returns
                outputs = job.outputs(path)
            except EXPORT_FAILURES as err:
                raise _ExportFailed("round", index, err, layers) from err
            narrowed = [r.name for r in layers if r.width_after < r.width_before]
            if narrowed and _identical(outputs, reference):
                raise _EvaluationFailed("round", index, f"round {index}'s export gave outputs identical to the dense "
                                        f"model's on every held-out input although {len(narrowed)} layers were "
                                        f"narrowed ({narrowed[0]}, ...): the check would compare a model with "
                                        "itself", layers)
            value = job.score(outputs, reference) if _finite(outputs) else math.nan
            if not math.isfinite(value):  # parity passes when PyTorch and ONNX Runtime overflow alike
                raise _EvaluationFailed("round", index, f"round {index}'s outputs on the held-out inputs are not "
                                        "finite (NaN or infinity): the pruned model is broken and no metric can "
                                        "vouch for it", layers)
            secondary = job.secondary(outputs, reference)
            also = "".join(f", {name} {baseline_secondary[name]:.4f} -> {v:.4f}" for name, v in secondary.items())
            say(f"round {index}: measured speedup {latency.speedup:.3f}x ({latency.baseline_ms:.1f} -> "
                f"{latency.compressed_ms:.1f} ms), {job.metric.name} {baseline_metric:.4f} -> {value:.4f}{also}")
            rounds.append(Round(plan, module, layers, path, parity, latency, value, predicted, secondary=secondary,
                                scored_sha256=scored))
            return rounds[-1]

        probes = 0

        def probe_model(module: nn.Module, index: int) -> Latency:
            nonlocal probes
            begin(index)
            probes += 1
            path = work / f"probe{probes}" / "model.onnx"
            path.parent.mkdir()
            try:
                return export_and_time(module, path)[1]
            except EXPORT_FAILURES as err:
                raise _ExportFailed("probe", index, err) from err
            finally:
                shutil.rmtree(path.parent, ignore_errors=True)

        def probe(plan: Widths, index: int) -> Latency:
            return probe_model(job.resize(plan), index)

        def retime(done: Round, index: int) -> Latency:
            assert done.onnx is not None
            say(f"round {index}: timing its export again")
            try:
                return timer(done.onnx)
            except EXPORT_FAILURES as err:
                raise _ExportFailed("round", index, err, done.layers) from err

        def trial(plan: Widths, index: int, predicted: float | None = None) -> Round:
            """A depth trial: the widths solved without the fit, exported, timed and scored; never a round of the
            job (its export goes once scored). The solved model stays with it where the kind can fit it later
            (`refits_solved`): the round that follows the best trial then skips the solves."""
            module, layers = job.prune(plan, fit=False)
            path = work / f"trial{index}" / "model.onnx"
            path.parent.mkdir()
            try:
                parity, latency = export_and_time(module, path)
                value = job.score(job.outputs(path), reference)
            except EXPORT_FAILURES as err:
                raise _ExportFailed("trial", index, err, layers) from err
            finally:
                shutil.rmtree(path.parent, ignore_errors=True)
            kept = module if getattr(job, "refits_solved", False) else None
            return Round(plan, kept, layers, None, parity, latency, value, predicted)

        if request.target_speedup is not None:  # fills `rounds`
            try:
                run_target(request, job, Measure(run_round, probe, probe_model, trial, retime), rounds,
                           baseline_metric, say, enter, version())
            except _OutOfTime as stop:
                say(warning(f"{stop}; the job returns the best of its {len(rounds)} round(s) (a larger --time-budget "
                            "lets it try more)"))
        elif request.widths_from is not None:
            removed = removed_of(request.widths_from)
            if removed and not request.remove_blocks:  # the same structure: its blocks or layers go too
                if not hasattr(job, "remove"):
                    raise InputError(f"--widths-from {request.widths_from}: it removed {removed}, and this model "
                                     "kind removes no whole blocks")
                say(f"--widths-from: removing {len(removed)} whole blocks as that report's model did")
                job.remove(removed)
            run_round(widths_of(request.widths_from), 0)
        else:
            _uniform_round(request, job, run_round, say)
        chosen, status = choose(request, rounds, job.metric, baseline_metric)
        graphs = _graphs(dense_onnx, chosen, feed, provider, request, say)
        decode = None
        if request.decode_step:  # before anything is saved: a failing decode step leaves no model.onnx
            say("exporting the decode step (decode.onnx)")
            decode = work / "decode" / "decode.onnx"
            decode.parent.mkdir()
            try:
                decode_parity = job.export_decode_step(chosen.module, decode)
            except EXPORT_FAILURES as err:
                raise _ExportFailed("decode_step", None, err, chosen.layers) from err
        enter("save", len(rounds) - 1)
        say("saving the pruned model and model.onnx")
        for name in EXPORT_FILES:  # an earlier job's in a reused --out (its decode step, its weights file) would
            (out / name).unlink(missing_ok=True)  # otherwise sit beside this model as if they were its own
        _clear_earlier_files(out, request)
        # and its report, which an interrupted save would leave describing files no longer there
        for name in ("report.json", "report.html"):
            (out / name).unlink(missing_ok=True)
        artifact = _save(request, job, chosen, out)
        report = build_report(request, job, chosen, rounds, status, baseline_metric, provider, artifact, start,
                              baseline_secondary)
        report.artifacts.serving = job.serving_files(out)
        report.pacing = pace.to_dict({i: _fits(r.layers, getattr(r.module, "osscar_model_fit", None))
                                      for i, r in enumerate(rounds)})
        if decode is not None:
            # decode.onnx, its external weights over 2 GB, and what ONNX Runtime GenAI reads beside it
            # (not the hidden files of an ONNX Runtime subprocess killed while it ran the graph in pieces)
            moved = sorted(path.name for path in decode.parent.iterdir() if not path.name.startswith("."))
            for name in moved:
                follow_umask(decode.parent / name)
                os.replace(decode.parent / name, out / name)
            report.artifacts.decode_step = {"path": "decode.onnx", "files": moved,
                                            "parity_max_abs_error": decode_parity.max_abs_error,
                                            "parity": dataclasses.asdict(decode_parity),
                                            # ONNX Runtime GenAI generates from the job's directory
                                            "genai_config": GENAI_CONFIG if (out / GENAI_CONFIG).is_file() else None}
        if status == "slower_than_dense":
            say(warning(f"the pruned model measured slower than dense ({chosen.latency.speedup:.3f}x < {MET}x)"))
        assert report.measured is not None
        report.measured.warnings = warnings
        report.measured.onnx_graph = graphs
        _write_report(report, out, enter)
        write_html(report, out / "report.html")
    except _ExportFailed as failure:
        if out_of_disk(failure.error) is not None:  # the disk refused a write (a piece's file): the machine's
            raise failure.error from failure.error.__cause__  # its cause is what out_of_disk read
        report = parity_failed_report(request, job, failure.stage, failure.index, failure.error, failure.layers,
                                      rounds, baseline_metric, provider, start)
        _clear_unvouched(out, request)  # an earlier job's, which this report would otherwise seem to describe
        _write_report(report, out, enter)
        say(f"{report.message}; wrote {out / 'report.json'} (no model.onnx)")
        return report
    except _EvaluationFailed as failure:
        report = evaluation_failed_report(request, job, failure.stage, failure.index, failure.detail, failure.layers,
                                          rounds, baseline_metric, provider, start)
        _clear_unvouched(out, request)  # as for parity_failed: nothing an unchecked model left may seem vouched for
        _write_report(report, out, enter)
        say(f"{report.message}; wrote {out / 'report.json'} (no model.onnx)")
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"{status}: measured speedup {report.measured.measured_speedup:.3f}x, {job.metric.name} "
        f"{report.metric.baseline:.4f} -> {report.metric.compressed:.4f}, params "
        f"{report.params_before} -> {report.measured.params_after}; wrote {out} in {report.elapsed_s:.1f}s")
    return report


def _write_report(report: Report, out: Path, clock: StageClock) -> None:
    """report.json, with where the job's time went up to now (every path that ends a job writes it here)."""
    report.stages = clock.times()
    write_text_atomically(out / "report.json", json.dumps(report.to_json(), indent=2))


def rounded_widths(units: list[tuple[str, int]], ratio: float, multiple: int) -> dict[str, int]:
    """Uniform-ratio widths rounded to the nearest multiple of `multiple` (at least one multiple, at most
    the full width; a layer no wider than the multiple keeps its unrounded width)."""
    plan = {}
    for name, groups in units:
        kept = groups - num_to_prune(groups, ratio)
        if groups > multiple and kept < groups:  # half-way rounds up: 0.5 of 12 at multiple 4 keeps 8
            kept = min(groups, max(multiple, multiple * math.floor(kept / multiple + 0.5)))
        plan[name] = kept
    return plan


def _uniform_round(request: CompressRequest, job: ModelJob, run_round: Callable[..., Round],
                   say: Say) -> None:
    """The paper's protocol: --uniform-ratio of every layer, one round; with --round-to the widths are
    rounded to its multiples (conv graphs), and without it a warning when the unrounded widths measure slower."""
    ratio = request.uniform_ratio
    assert ratio is not None
    units = [(u.name, u.channels) for u in job.analysis.units] if isinstance(job, ConvJob) else None
    if request.round_to is not None and units is not None:
        plan = rounded_widths(units, ratio, request.round_to)
        say(f"uniform ratio {ratio}, widths rounded to multiples of {request.round_to}: "
            + ", ".join(f"{n} {c}->{plan[n]}" for n, c in units))
        run_round(plan, 0)
        return
    if request.round_to is not None:
        say(warning(f"--round-to {request.round_to} is applied in uniform mode to conv graphs only; this model's "
            "widths are not rounded"))
    result = run_round(ratio, 0)
    if units is None:  # --round-to rounds a conv graph's channels only: no advice to give a transformer
        return
    odd = sorted({r.width_after for r in result.layers if r.width_after % ROUND_TO and r.width_after != r.width_before})
    if odd and result.latency.speedup < 1.0:
        say(warning(f"the unrounded uniform widths ({', '.join(map(str, odd[:6]))}{' ...' if len(odd) > 6 else ''}) "
            f"measured slower than dense ({result.latency.speedup:.3f}x); --round-to {ROUND_TO} rounds them to "
            "hardware-friendly multiples"))


def _fits(layers: list[LayerReport], model_fit: RefineReport | None = None) -> dict[str, float]:
    """A round's reconstruction in sum: the steps its fits ran and the seconds they took (the layers' or blocks',
    and a transformer's whole-model fit after them: the allowance paid for both)."""
    fits = [r.refine for r in layers if r.refine is not None] + ([model_fit] if model_fit is not None else [])
    return {"fit_steps": sum(f.steps for f in fits), "fit_s": round(sum(f.seconds for f in fits), 1)}


def _graphs(dense_onnx: Path, chosen: Round, feed: dict, provider: str, request: CompressRequest,
            say: Say) -> dict | None:
    """The graphs the speedup compares (their ONNX Runtime fusions), and both timed as exported: report.json
    `measured.onnx_graph`. None for a kind whose exports are not fused (conv graphs)."""
    if chosen.onnx is None:
        return None
    dense, compressed = fusion_of(dense_onnx), fusion_of(chosen.onnx)
    if dense is None or compressed is None:
        return None
    graphs: dict = {"dense": dense.to_json(), "compressed": compressed.to_json(), "as_exported": None}
    plain_dense, plain = unfused_path(dense_onnx), unfused_path(chosen.onnx)
    if plain_dense.is_file() and plain.is_file():
        say("timing the dense and the returned model as exported, without ONNX Runtime's fused kernels")
        try:
            raw = measure_latency(plain_dense, plain, feed, provider=provider, threads=request.threads,
                                  repeats=request.repeats)
            graphs["as_exported"] = {"baseline_ms": raw.baseline_ms, "compressed_ms": raw.compressed_ms,
                                     "speedup": raw.speedup}
        except (RuntimeFailure, RuntimeKilled) as err:  # the shipped graphs were measured; for comparison only
            say(warning(f"the graphs as exported could not be timed: {err}"))
    return graphs


def _clear_unvouched(out: Path, request: CompressRequest) -> None:
    """A failed job's --out: no model.onnx, decode step or pruned model that its report would seem to vouch for
    (this job's unchecked ones, or an earlier job's in a reused folder). A pruned model that is this job's own
    input (`compress out/model.pt2 --out out`) stays."""
    for name in EXPORT_FILES:
        (out / name).unlink(missing_ok=True)
    _clear_earlier_files(out, request)
    for name in sorted(set(JOB_OUTPUTS) - set(JOB_EXPORTS)):  # the pruned model: model.pt2 or model/
        path = (out / name).resolve()
        if request.reads(path):
            continue
        if path.is_dir() and not (out / name).is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            (out / name).unlink(missing_ok=True)


def _clear_earlier_files(out: Path, request: CompressRequest) -> None:
    """The files an earlier job's report.json in this --out lists as its own (`earlier_job_files`), unless this job
    reads them."""
    for name in earlier_job_files(out):
        if not request.reads(out / name):
            (out / name).unlink(missing_ok=True)


def _save(request: CompressRequest, job: ModelJob, chosen: Round, out: Path) -> str:
    """The chosen round's pruned model and model.onnx (with provenance) into `out`; returns the model's
    artifact name. The ONNX graph is checked first: a mismatch leaves no pruned model written."""
    os.replace(chosen.onnx, out / "model.onnx")
    if file_sha256(out / "model.onnx") != chosen.scored_sha256:
        raise _EvaluationFailed("save", None, "the model.onnx about to be returned is not the file the accuracy "
                                "check scored", chosen.layers)
    artifact = job.save(chosen.module, out)
    # the other kind's pruned model, an earlier job's in a reused --out, would seem this model's (`_check_here`
    # made sure a model/ folder there is a job's); not when this job read it
    other = out / ("model" if artifact == "model.pt2" else "model.pt2")
    if other.is_dir() and not other.is_symlink() and not request.reads(other):
        shutil.rmtree(other)
    elif other.exists() and not request.reads(other):
        other.unlink()
    for data in chosen.onnx.parent.glob("*.data"):  # external weights of a model over 2 GB
        os.replace(data, out / data.name)
    stamp_metadata(out / "model.onnx", {
        "osscar.source_model": str(request.model), "osscar.method": request.method,
        "osscar.calibration": str(request.calibration), "osscar.calibration_sha256": file_sha256(request.calibration),
        "osscar.seed": request.seed, "osscar.version": version(), "osscar.preprocessing": job.preprocessing(),
        "osscar.widths": {r.name: r.width_after for r in chosen.layers}})
    # readable as any file the user writes (safetensors creates its files 0600)
    for name in (artifact.rstrip("/"), "model.onnx", *(p.name for p in out.glob("model.onnx*.data"))):
        follow_umask(out / name)
    return artifact
