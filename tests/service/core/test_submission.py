"""Validating a submission: every violation listed, references resolved, the model checked against the
compressor's architecture rules."""

import asyncio
import json
from pathlib import Path

import pytest

from service.core import JobService, SubmitRequest
from service.core.submission import check_model
from service.errors import FailedPrecondition, InvalidArgument, NotFound
from tests.service.core.service_helpers import service


def submit(jobs: JobService, **spec) -> None:
    request = SubmitRequest(spec={"uniform_ratio": 0.5, **spec}, body=b"", body_sha256="x")
    asyncio.run(jobs.submit(request))


def test_submit_lists_every_violation_and_resolves_references(tmp_path):
    jobs = service(tmp_path)
    with pytest.raises(InvalidArgument) as err:
        submit(jobs, model="relative.pt2", calibration="", method="magic", samples=0)
    fields = {v.field for v in err.value.violations}
    assert {"model", "calibration", "method", "samples"} <= fields
    with pytest.raises(NotFound, match="no such model"):
        submit(jobs, model=str(tmp_path / "missing.pt2"), calibration="embedded:calibration.txt")
    folder = tmp_path / "bert-like"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "opt", "do_layer_norm_before": false}')
    with pytest.raises(FailedPrecondition) as refused:
        submit(jobs, model=str(folder), calibration="embedded:calibration.txt")
    assert refused.value.reason == "UNSUPPORTED_ARCHITECTURE" and "post-norm OPT" in str(refused.value)
    built = list((jobs.home / "embedded").glob("calibration-stdlib-*.txt"))  # built once, on demand
    assert len(built) == 1 and built[0].read_text().count("\n\n") >= 200


def test_a_linked_input_keeps_the_name_it_was_given_and_the_target_that_was_checked(tmp_path):
    """A Hugging Face cache's snapshot links `model.pt2` to a blob without an extension: the submission accepts it by
    the link's name (it refused a "suffix-less file"), and the job reads the checked target under that name, so the
    link pointed elsewhere after the check leads nowhere new."""
    from service.core.references import named_inputs

    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "0a1b2c").write_bytes(b"program")
    (blobs / "3d4e5f").write_text('{"text": "calibration"}\n')
    snapshot = tmp_path / "hub" / "snapshots" / "main"
    snapshot.mkdir(parents=True)
    (snapshot / "model.pt2").symlink_to(blobs / "0a1b2c")
    (snapshot / "calibration.jsonl").symlink_to(blobs / "3d4e5f")
    jobs = service(tmp_path)
    references = {"model": str(snapshot / "model.pt2"), "calibration": str(snapshot / "calibration.jsonl")}
    request = SubmitRequest(spec={"uniform_ratio": 0.5, **references}, body=b"", body_sha256="x")
    record = asyncio.run(jobs.submit(request))
    resolved = record.spec["resolved"]
    assert resolved["model"] == str(blobs / "0a1b2c") and record.spec["references"] == references
    (snapshot / "model.pt2").unlink()
    (snapshot / "model.pt2").symlink_to(tmp_path / "elsewhere.pt2")  # pointed away after the check
    named = named_inputs(resolved, references, tmp_path / "work" / "inputs")
    assert Path(named["model"]).name == "model.pt2" and Path(named["calibration"]).name == "calibration.jsonl"
    assert Path(named["model"]).read_bytes() == b"program" and Path(named["model"]).resolve() == blobs / "0a1b2c"
    assert named["uniform_ratio"] == 0.5 and resolved["model"] == str(blobs / "0a1b2c")  # the spec is left as it was
    embedded = named_inputs({"calibration": str(blobs / "3d4e5f")}, {"calibration": "blob:sha256:ab/data.jsonl"},
                            tmp_path / "w2")
    assert embedded == {"calibration": str(blobs / "3d4e5f")}  # an upload's view already has its name


@pytest.mark.parametrize("config, refusal", [
    ({"model_type": "opt", "do_layer_norm_before": False}, "UNSUPPORTED_ARCHITECTURE"),
    ({"model_type": "qwen2_moe", "num_experts": 0}, "UNSUPPORTED_ARCHITECTURE"),  # no routed experts: a dense model
    ({"model_type": "opt"}, "safetensors"),  # pre-norm OPT passes the architecture check
    ({"model_type": "resnet", "num_channels": 3}, "safetensors"),  # an image model: pruned as a conv graph
    ([1, 2], "not a JSON object"),
])
def test_the_model_check_uses_the_compressors_architecture_rules(tmp_path, config, refusal):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises((FailedPrecondition, InvalidArgument)) as err:
        check_model(tmp_path, "the-model")
    assert refusal in (getattr(err.value, "reason", "") + str(err.value))
    if refusal == "UNSUPPORTED_ARCHITECTURE":
        assert err.value.metadata["model_type"] == config["model_type"]
    (tmp_path / "model.safetensors").write_bytes(b"")
    if refusal == "safetensors":
        check_model(tmp_path, "the-model")  # now acceptable


def test_validation_runs_off_the_event_loop_and_one_request_id_stays_one_job(tmp_path, monkeypatch):
    """A directory's walk or the first embedded text's build takes seconds: health checks, watches and the
    scheduler keep answering meanwhile. Two calls with one request_id at once still make one operation."""
    import time

    from service.core import service as service_module

    jobs = service(tmp_path)
    model = tmp_path / "model.pt2"
    model.write_bytes(b"x")
    (tmp_path / "cal.txt").write_text("Some calibration text.\n")
    real = service_module.validate

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(service_module, "validate", slow)
    request = SubmitRequest(spec={"uniform_ratio": 0.5, "model": str(model), "calibration": str(tmp_path / "cal.txt")},
                            body=b"", body_sha256="x", request_id="3f2b5c1e-0000-4000-8000-000000000001")

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        first, second = await asyncio.gather(jobs.submit(request), jobs.submit(request))
        ticker.cancel()
        return first, second, ticks

    first, second, ticks = asyncio.run(main())
    assert ticks >= 10  # the loop ran while both validated
    assert first.name == second.name and jobs.store.count("QUEUED") == 1
