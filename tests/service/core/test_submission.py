"""Validating a submission: every violation listed, references resolved, the model checked against the
compressor's architecture rules."""

import asyncio
import json

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


@pytest.mark.parametrize("config, refusal", [
    ({"model_type": "opt", "do_layer_norm_before": False}, "UNSUPPORTED_ARCHITECTURE"),
    ({"model_type": "mixtral"}, "UNSUPPORTED_ARCHITECTURE"),  # experts: not a prunable unit yet
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
