"""What a submission must pass before it is queued: every field violation at once, references resolved
(under the server's reference policy), labels, the time budget, the request's own checks
(`CompressRequest.violations`) and the model (a loadable format and a supported architecture).

Refusals are `service.errors`: INVALID_ARGUMENT with every violation, NOT_FOUND for a reference that does
not exist, FAILED_PRECONDITION `UNSUPPORTED_ARCHITECTURE`, PERMISSION_DENIED from the policy.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import FailedPrecondition, FieldViolation, InvalidArgument, NotFound
from ..fields import label_violations
from ..job.request import MAX_TIME_BUDGET_S
from .blobs import BlobStore
from .policy import ReferencePolicy
from .references import input_name, resolve

REQUIRED = ("model", "calibration")


@dataclass
class SubmitRequest:
    """A Compress call, as the transport received it."""

    spec: dict[str, Any]  # CompressRequest fields; model/calibration/eval/widths_from are references
    body: bytes  # the request's canonical serialization (echoed back; its digest settles request_id reuse)
    body_sha256: str  # of the body without the request_id
    labels: dict[str, str] = field(default_factory=dict)
    request_id: str = ""
    time_budget_s: float | None = None


@dataclass(frozen=True)
class Accepted:
    """A submission that passed: the job's spec (references resolved to paths) and the references as given."""

    resolved: dict[str, Any]
    references: dict[str, str]


def validate(request: SubmitRequest, *, home: Path, blobs: BlobStore, policy: ReferencePolicy) -> Accepted:
    """Every check of a submission; raises the first kind of refusal with all of its violations. Reads files
    only (the service runs it in a thread: a directory's walk, the first embedded text's build take seconds),
    never the job store."""
    from ..job.request import REFERENCES, request_from_spec

    violations: list[FieldViolation] = []
    not_found: list[NotFound] = []
    spec = dict(request.spec)
    references = {}
    for key in REFERENCES:
        reference = spec.get(key)
        if not reference:
            if key in REQUIRED:
                violations.append(FieldViolation(key, "required"))
            spec[key] = None
            continue
        references[key] = reference
        try:
            spec[key] = str(resolve(reference, key, REFERENCES[key], blobs, home, policy))
        except InvalidArgument as err:
            violations += err.violations
            spec[key] = None  # refused: not looked at again
        except NotFound as err:
            not_found.append(err)
            spec[key] = None
    violations += label_violations(request.labels)
    budget = request.time_budget_s
    if budget is not None and not (math.isfinite(budget) and 0 < budget <= MAX_TIME_BUDGET_S):
        violations.append(FieldViolation("time_budget", f"must be positive and at most {MAX_TIME_BUDGET_S}s "
                                                        f"(got {budget})"))
    try:
        found = request_from_spec(spec, out_dir=Path("/nonexistent")).violations()
    except TypeError as err:  # a transport bug, not the caller's: surfaces as INTERNAL
        raise RuntimeError(f"request fields do not match CompressRequest: {err}") from err
    # references were checked when resolved above
    violations += [FieldViolation(f, m) for f, m in found if f not in REFERENCES]
    if violations:
        raise InvalidArgument(violations)
    if not_found:
        raise not_found[0]
    check_model(Path(spec["model"]), references["model"])
    spec["trust_remote_code"] = policy.trusts_code(Path(spec["model"]))
    return Accepted(spec, references)


def check_model(path: Path, reference: str) -> None:
    """A .pt2 program, or a Hugging Face directory with config.json of an architecture the compressor prunes
    (`compressor.transformer.adapters.check_config`) and safetensors weights (pickles can run code). `path`: the
    resolved reference, `reference`: as the request gave it (a link's name is the one the job reads)."""
    from compressor.errors import UnsupportedArchitecture
    from compressor.transformer.adapters import check_config

    if path.is_file():
        suffix = Path(input_name(reference, path)).suffix  # the name the job reads (`named_inputs`)
        if suffix != ".pt2":
            raise InvalidArgument([FieldViolation("model", f"{reference}: expected a .pt2 torch.export program "
                                                           f"or a Hugging Face model directory, got a "
                                                           f"{suffix or 'suffix-less'} file")])
        return
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InvalidArgument([FieldViolation("model", f"{reference}: a directory without config.json; expected "
                                                       "a Hugging Face model directory")])
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        raise InvalidArgument([FieldViolation("model", f"{reference}: config.json is not valid JSON")]) from None
    if not isinstance(config, dict):
        raise InvalidArgument([FieldViolation("model", f"{reference}: config.json is not a JSON object")])
    try:
        check_config(config, reference)
    except UnsupportedArchitecture as err:
        raise FailedPrecondition("UNSUPPORTED_ARCHITECTURE", str(err),
                                 {"model_type": str(config.get("model_type"))}) from None
    if not any(path.glob("*.safetensors")):
        raise InvalidArgument([FieldViolation("model", f"{reference}: no *.safetensors weights; only "
                                                       "safetensors are loaded (pickled pytorch_model.bin files "
                                                       "can run code)")])
