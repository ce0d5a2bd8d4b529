"""The `osscar` CLI and its demo on the embedded real model (all-MiniLM-L6-v2 from PyPI)."""

import logging

import pytest

from service.client import cli
from service.client.demo import METHODS, run_demo
from service.embedded import calibration_texts


def test_calibration_texts_are_seeded_and_long_enough():
    texts = calibration_texts()
    assert texts == calibration_texts()  # seeded
    assert len(texts) == 96 and all(len(t.split()) > 50 for t in texts)


@pytest.fixture(scope="module")
def demo_results():
    return run_demo(ratio=0.5)


def test_demo_prunes_every_layer_and_osscar_is_best_on_average(demo_results):
    assert len(demo_results) == 12  # 6 layers x (attention output, FFN output)
    heads = [r for r in demo_results if "attention" in r.layer]
    assert all(r.groups == 12 and r.pruned == 6 for r in heads)
    ffn = [r for r in demo_results if "attention" not in r.layer]
    assert all(r.groups == 1536 and r.pruned == 768 for r in ffn)
    mean = {m: sum(r.errors[m] for r in demo_results) / len(demo_results) for m in METHODS}
    assert mean["osscar"] < mean["thinet"] < mean["mp+"] < mean["mp"]
    for r in demo_results:  # never worse than MP+, layer by layer
        assert r.errors["osscar"] <= r.errors["mp+"] + 1e-9
        assert all(0 <= e <= 1.0 for e in r.errors.values())


def test_cli_demo_prints_the_table(capsys, monkeypatch, demo_results):
    monkeypatch.setattr("service.client.demo.run_demo", lambda ratio, model: demo_results)
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "layer.5.output.dense" in out and out.strip().splitlines()[-1].startswith("mean")


@pytest.mark.parametrize("ratio", ["0", "1", "1.5", "-0.2"])
def test_cli_rejects_bad_ratios_with_one_line(ratio, capsys):
    assert cli.main(["demo", "--ratio", ratio]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # one line: the header came before the check
    assert len(err) == 1 and err[0].startswith("osscar: error: --ratio must be in (0, 1)")


def test_verbose_is_taken_after_the_command_too():
    parser = cli.build_parser()
    for argv in (["-v", "health"], ["health", "-v"], ["operations", "list", "--verbose"]):
        assert parser.parse_args(argv).verbose
    assert not parser.parse_args(["health"]).verbose


def test_the_demo_on_a_short_bert_and_on_a_directory_without_a_tokenizer(tmp_path, capsys):
    """A model of 64 positions ran 256-token windows (a traceback); a directory without tokenizer files got a
    tokenizer of a few tokens built from its config."""
    import shutil

    import torch
    import transformers

    from service.embedded import default_model_path

    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=24, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(tmp_path / "bert")
    assert cli.main(["demo", "--model", str(tmp_path / "bert")]) == 2
    assert "no tokenizer files" in capsys.readouterr().err
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        if (default_model_path() / name).is_file():
            shutil.copyfile(default_model_path() / name, tmp_path / "bert" / name)
    assert cli.main(["demo", "--model", str(tmp_path / "bert"), "--ratio", "0.5"]) == 0
    assert "layer.0." in capsys.readouterr().out


def test_cli_without_a_command_exits_nonzero():
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code != 0


def test_serve_has_a_flag_for_every_setting_but_the_secret_tokens():
    from service.server.settings import ServerSettings

    serve = cli.build_parser()._subparsers._group_actions[0].choices["serve"]
    dests = {a.dest: a for a in serve._actions}
    assert set(ServerSettings.model_fields) - set(cli.SERVE_NOT_FLAGS) <= set(dests)
    assert "tokens" not in dests  # secrets never on the command line
    assert dests["grace_s"].option_strings == ["--grace"]
    assert all(dests[name].help for name in ServerSettings.model_fields if name in dests)
    args = cli.build_parser().parse_args(["serve", "--max-queue", "3", "--log-format", "text", "--insecure"])
    assert (args.max_queue, args.log_format, args.insecure, args.port) == (3, "text", True, None)


def test_help_shows_a_default_of_zero():
    """0 == False: a default of 0 (the seed's, the Ray CPUs') was dropped from the help with the False ones."""
    commands = cli.build_parser()._subparsers._group_actions[0].choices
    helps = {name: {a.dest: a.help for a in commands[name]._actions} for name in ("compress", "serve")}
    assert helps["compress"]["seed"].endswith("(default 0)")
    assert helps["serve"]["ray_cpus_per_job"].endswith("(default 0)")
    assert "(default" not in helps["compress"]["stream"]  # a False default stays unshown


# ---- Ctrl-C on a local job ---------------------------------------------------------------------------


def test_ctrl_c_on_a_local_job_exits_130_with_one_line_and_removes_its_output(tmp_path):
    from tests.compressor.cnn.conv_models import write_conv_job
    from tests.service.client.test_remote import compress_args, interrupt_when

    (tmp_path / "data").mkdir()
    data = write_conv_job(tmp_path / "data", size=32)
    fresh = tmp_path / "fresh"
    code, _, after = interrupt_when(compress_args(data, fresh, 3000), "exporting and measuring")
    assert code == 130
    assert after == [f"osscar: interrupted; removed {fresh} (this run created it)"]  # no traceback
    assert not fresh.exists()

    kept = tmp_path / "kept"  # an existing directory: what was there stays, nothing of the run remains
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    (kept / "report.json").write_text("{}")  # an earlier run's
    code, _, after = interrupt_when(compress_args(data, kept, 3000), "exporting and measuring")
    assert code == 130 and len(after) == 1 and after[0].startswith("osscar: interrupted;")
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt", "report.json"]
    assert (kept / "report.json").read_text() == "{}"
    # SIGTERM alone (`timeout`, `docker stop`): the same clean-up; it left the run's scratch in --out for good
    code, _, after = interrupt_when(compress_args(data, kept, 3000), "exporting and measuring", terminate=True)
    assert code == 130 and len(after) == 1 and after[0].startswith("osscar: interrupted;"), after
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt", "report.json"]


def test_cuda_out_of_memory_in_a_local_job_is_one_line_with_the_stage_and_exit_2(tmp_path, capsys, monkeypatch):
    import torch

    from tests.compressor.cnn.conv_models import write_conv_job
    from tests.service.client.test_remote import compress_args

    def compress(request, progress=None, stage=None):
        stage("pruning", 0)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 ...")

    monkeypatch.setattr("service.job.compress", compress)
    data = write_conv_job(tmp_path, size=32)
    out = tmp_path / "out"
    assert cli.main(compress_args(data, out, 3)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["osscar: the job ran out of CUDA memory in stage pruning (it tried to allocate 512.00 MiB); "
                     f"removed {out} (this run created it)"]


def test_a_local_job_on_a_later_gpu_sees_that_gpu_alone(tmp_path, monkeypatch):
    """`--device cuda:1` pruned on GPU 1 and timed on GPU 0 (ONNX Runtime's CUDA provider takes device 0): the job
    now sees GPU 1 alone, as device 0, as a server's slot does."""
    import os

    import service.job
    from tests.compressor.cnn.conv_models import write_conv_job
    from tests.service.client.test_remote import compress_args

    seen, unpatched = {}, service.job.compress

    def compress(request, progress=None, stage=None):
        seen.update(device=request.device, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
        raise KeyboardInterrupt

    monkeypatch.setattr("service.job.compress", compress)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    data = write_conv_job(tmp_path, size=32)
    assert cli.main([*compress_args(data, tmp_path / "out", 3), "--device", "cuda:1"]) == 130
    assert seen == {"device": "cuda:0", "visible": "1"}
    # a device that is no device is the request's check to refuse (int() raised a traceback before it)
    monkeypatch.setattr("service.job.compress", unpatched)
    for bad in ("cuda:abc", "cuda:", "cuda:-1"):
        assert cli.main([*compress_args(data, tmp_path / "out", 3), "--device", bad]) == 2
    monkeypatch.setattr("service.job.compress", compress)
    # GPUs hidden on purpose stay hidden, and one that is not there stays as asked (the job names it)
    for hidden, asked in (("", "cuda:0"), ("0,1", "cuda:2")):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert cli.main([*compress_args(data, tmp_path / "out", 3), "--device", asked]) == 130
        assert seen == {"device": asked, "visible": hidden}


def test_written_outputs_takes_back_new_and_changed_job_outputs_only(tmp_path):
    import os

    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "model" / "config.json").write_text("old")
    for name, text in (("report.json", "old"), ("model.onnx", "old"), ("notes.txt", "mine")):
        (out / name).write_text(text)
    old = os.stat(out / "model.onnx").st_mtime_ns - 10**9
    for path in (out / "model" / "config.json", out / "model.onnx", out / "report.json"):
        os.utime(path, ns=(old, old))
    written = cli.WrittenOutputs(out)
    (out / "model.onnx").write_text("new, half-written")  # changed by the run
    (out / "model" / "weights.safetensors").write_text("new")  # a new file inside an old directory
    (out / "report.html").write_text("new")  # new
    (out / ".osscar-work-x").mkdir()  # the job's scratch
    (out / "other.txt").write_text("not a job output")  # someone else's
    message = written.undo()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "other.txt", "report.json"]
    assert (out / "report.json").read_text() == "old"
    assert message == f"removed what this run wrote in {out} (.osscar-work-x, model, model.onnx, report.html)"


def test_verbose_shows_our_progress_and_only_the_warnings_of_other_libraries():
    from service.logs import OURS

    names = ("", *OURS, "onnx_ir", "onnxscript")
    levels = {name: logging.getLogger(name).level for name in names}
    try:
        cli._configure_logging(True)
        assert logging.getLogger("compressor.transformer.pipeline").isEnabledFor(logging.INFO)
        assert logging.getLogger("service.job.compress").isEnabledFor(logging.INFO)
        # the exporter's passes log every rewrite at INFO, some with a stack trace
        assert not logging.getLogger("onnx_ir.passes.common.unused_removal").isEnabledFor(logging.INFO)
        assert not logging.getLogger("onnxscript.rewriter").isEnabledFor(logging.INFO)
        assert logging.getLogger("onnxscript.rewriter").isEnabledFor(logging.WARNING)
        cli._configure_logging(False)
        assert not logging.getLogger("compressor.transformer.pipeline").isEnabledFor(logging.INFO)
        assert logging.getLogger("exporters.onnx").isEnabledFor(logging.WARNING)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def test_flags_a_local_job_cannot_honour_are_one_line_before_anything_runs(tmp_path, capsys):
    """--upload, --label, ... without --server, and an --out that is a file: exit 2 with one line each (the first
    ran the job locally, ignoring them; the second ended in a traceback)."""
    base = ["compress", str(tmp_path / "m.pt2"), "--uniform-ratio", "0.5", "--calibration", str(tmp_path / "c.npz")]
    assert cli.main([*base, "--out", str(tmp_path / "o"), "--upload", "--label", "team=a"]) == 2
    assert capsys.readouterr().err.strip() == \
        "osscar: error: --upload, --label only with --server (this job would run here)"
    (tmp_path / "a-file").write_text("")
    assert cli.main([*base, "--out", str(tmp_path / "a-file")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("osscar: error: --out ") and "is a file" in err and "\n" not in err
    # the call deadlines bound no local job (they were ignored), and an empty --out (an unset `$OUT`) was the current
    # directory, whose model/ folder the job replaced
    assert cli.main([*base, "--out", str(tmp_path / "o"), "--timeout", "1"]) == 2
    assert capsys.readouterr().err.strip() == "osscar: error: --timeout only with --server (this job would run here)"
    with pytest.raises(SystemExit) as refused:
        cli.main([*base, "--out", ""])
    assert refused.value.code == 2 and "an empty path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["operations", "list", "--timeout", "-1"])
    assert "must be a positive number of seconds" in capsys.readouterr().err


def test_a_local_job_into_an_out_another_command_holds_is_refused_and_touches_nothing(tmp_path, capsys):
    """Two local jobs into one --out replaced and removed each other's files, and one interrupted took back the other's
    results (its model, model.onnx and reports, or its scratch mid-job). A job holds its --out now; a second is
    refused in one line before it loads anything."""
    import fcntl
    import os

    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("{}")
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)  # the other job
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        code = cli.main(["compress", str(tmp_path / "m.pt2"), "--uniform-ratio", "0.5", "--calibration",
                         str(tmp_path / "c.npz"), "--out", str(out)])
    finally:
        os.close(fd)
    assert code == 2
    assert capsys.readouterr().err.strip() == (f"osscar: error: another osscar command is writing into {out} (a job or "
                                                "a download); wait for it to end or give another --out")
    assert [p.name for p in out.iterdir()] == ["report.json"]
    fresh = tmp_path / "fresh"  # a refusal after the folder was made for the job leaves none behind
    assert cli.main(["compress", str(tmp_path / "m.pt2"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "c.npz"), "--out", str(fresh)]) == 2
    assert not fresh.exists()


def test_a_health_probe_imports_no_torch():
    """`osscar health` (the image's HEALTHCHECK, every 30 s) imported torch and transformers through compress's flag
    schema and the packages' __init__: seconds of a 10 s probe on a busy GPU node."""
    import subprocess
    import sys

    probe = ("import sys\nfrom service.client import cli\n"
             "code = cli.main(['health', '--server', '127.0.0.1:9', '--timeout', '0.5'])\n"
             "heavy = sorted(m for m in ('torch', 'transformers', 'onnxruntime') if m in sys.modules)\n"
             "print(code, heavy)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "1 []", result.stdout + result.stderr
