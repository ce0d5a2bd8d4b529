"""`osscar compress`'s flags, one per `CompressRequest` field, and the request they make: the options
a local job runs with (`compress_options`) and the gRPC request a remote one is submitted as
(`build_request`: references made absolute or uploaded)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import typing
import uuid
from pathlib import Path
from typing import Any

from ..api import compression_pb2 as pb
from ..api.wire import (
    spec_to_proto,
)
from ..embedded import is_remote_reference
from ..errors import InvalidArgument
from ..fields import check_request_id, label_violations
from ..files import valid_filename
from .transport import ClientError, RemoteCompressor


def build_request(args: argparse.Namespace, client: RemoteCompressor, *, upload: bool = True,
                  uploaded: dict[str, str] | None = None) -> pb.CompressRequest:
    """The Compress request of the command's flags: the options it set (the server applies the same
    defaults to the rest), references made absolute or, with --upload (and `upload`), uploaded. `uploaded`: the
    blob references of files sent before, by local path (reused, not sent again), and where each upload is kept."""
    from ..job.request import LOCAL_ONLY, MAX_TIME_BUDGET_S, REFERENCES, SHAPE_KEYS, request_from_spec

    def reference(value) -> str:
        text = str(value)
        if is_remote_reference(text):
            return text
        path = Path(text).expanduser()
        if args.upload and upload:  # the files were checked below, before the first upload
            local = os.path.abspath(path)
            if uploaded is not None and local in uploaded:
                print(f"{path}: sent by an earlier run of this command ({uploaded[local]})", file=sys.stderr)
                return uploaded[local]
            print(f"uploading {path}", file=sys.stderr)
            blob = client.upload(path)
            if uploaded is not None:
                uploaded[local] = blob
            return blob
        return os.path.abspath(path)  # not resolved: a link keeps its name (its target may have no extension)

    budget = args.time_budget
    if budget is not None and not (math.isfinite(budget) and 0 < budget <= MAX_TIME_BUDGET_S):
        raise ClientError(f"--time-budget must be a positive number of seconds, at most {MAX_TIME_BUDGET_S:g} "
                          f"(got {budget})")
    options = {k: v for k, v in compress_options(args).items() if k not in LOCAL_ONLY}
    # the checks a local run makes of the values (not of the files: the server resolves those), before anything
    # is uploaded: a shape key misspelt, a budget that is not a number, a batch of 0 the wire would read as unset
    found = request_from_spec(options, out_dir=Path("/nonexistent")).violations()
    wrong = [message for name, message in found if name not in REFERENCES]
    if wrong:
        raise ClientError("; ".join(wrong))
    try:  # every value fits its field
        spec_to_proto(options)
    except (ValueError, AttributeError) as err:
        raise ClientError(str(err)) from None
    # the request's own fields and every file, before the first upload (a model of gigabytes sent for nothing)
    try:
        if args.request_id is not None:
            check_request_id(args.request_id)
        if bad_labels := label_violations(dict(args.label or [])):
            raise InvalidArgument(bad_labels)
    except InvalidArgument as err:
        raise ClientError(str(err)) from None
    if args.upload:  # checked by the first call too (`upload` False): before a run's mark is written
        given = [Path(str(options[n])).expanduser() for n in REFERENCES
                 if n in options and not is_remote_reference(str(options[n]))]
        if missing := [str(path) for path in given if not path.exists()]:
            raise ClientError(f"--upload: no such file or directory: {', '.join(missing)}")
        if unnamed := [path.name for path in given if not valid_filename(Path(os.path.abspath(path)).name)]:
            raise ClientError(f"--upload: {', '.join(unnamed)}: an uploaded file keeps its name, which must be ASCII "
                              "letters, digits, spaces and ._+- (rename it or link it under such a name)")
    for name in REFERENCES:
        if name in options:
            options[name] = reference(options[name])
    bad = sorted(set(options.get("shape", {})) - set(SHAPE_KEYS))
    if bad:
        raise ClientError(f"--shape takes batch=N and sequence=N (got {', '.join(bad)})")
    request = spec_to_proto(options, pb.CompressRequest(request_id=args.request_id or str(uuid.uuid4()),
                                                        labels=dict(args.label or [])))
    if args.time_budget is not None:
        request.time_budget.FromMilliseconds(int(args.time_budget * 1000))
    return request


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from err


def _shape(text: str) -> dict[str, int]:
    try:
        pairs = [item.split("=", 1) for item in text.split(",") if item]
        return {k.strip(): int(v) for k, v in pairs}
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected name=N pairs such as batch=8,sequence=128, got {text!r}") from err


NONE = "none"


# flags that also take the literal `none`, and the request field it sets (a float cannot say "off")
NONE_FLAGS = {"accuracy_budget": "no_accuracy_budget"}


def _number_or_none(text: str) -> float | str:
    if text.strip().lower() == NONE:
        return NONE
    try:
        return float(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a number or none, got {text!r}") from err


def label_flag(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def compress_options(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields the command line set (absent flags: the request's defaults apply)."""
    from ..job.request import CompressRequest

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(CompressRequest)
               if f.metadata["cli"] and getattr(args, f.name, None) is not None}
    for name, switch in NONE_FLAGS.items():
        if options.get(name) == NONE:
            del options[name]
            options[switch] = True
    return options


def _flag_type(kind: Any) -> Any:
    """The argparse `type` of a field type."""
    origin = typing.get_origin(kind) or kind
    if origin is tuple:
        return _floats
    if origin is dict:
        return _shape
    if origin is Path:
        return _path
    return kind


def _path(value: str) -> Path:
    """A path flag's value; an empty one (an unset variable: `--out "$OUT"`) would be the current directory."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?); give a file or folder")
    return Path(value)


def _default_text(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" for v in value)
    return str(value)


def add_request_flags(parser: argparse.ArgumentParser) -> None:
    """`osscar compress`'s flags, one per CompressRequest field (service.job.request holds the help and
    defaults; argparse defaults stay None so that an absent flag means the request's default)."""
    from ..job.request import MODES, CompressRequest, field_types

    types = field_types()
    mode = parser.add_mutually_exclusive_group(required=True)
    for f in dataclasses.fields(CompressRequest):
        meta = f.metadata
        if not meta["cli"]:
            continue
        help_text = meta["help"]
        # by identity: a default of 0 (the seed's) equals False, and is one to show
        if not any(f.default is unset for unset in (None, False, dataclasses.MISSING)):
            help_text += f" (default {_default_text(f.default)})"
        if f.name == "model":
            parser.add_argument("model", help=help_text)
            continue
        flag = "--out" if f.name == "out_dir" else "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if types[f.name] is bool:
            kwargs["action"] = "store_true"
        else:
            kind = _number_or_none if f.name in NONE_FLAGS else _flag_type(types[f.name])
            kwargs.update(type=kind, choices=meta["choices"], metavar=meta["metavar"])
        if f.name in ("calibration", "out_dir"):
            kwargs["required"] = True
        (mode if f.name in MODES else parser).add_argument(flag, **kwargs)


def seconds(value: str) -> float:
    """A positive, finite number of seconds."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from None
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (got {value})")
    return number


def add_connection_flags(parser, connect_timeout: float) -> None:
    """How a client reaches a server (besides --server): deadlines, TLS and the bearer token."""
    # defaults None, filled in by `connect`: a local `osscar compress` refuses them as given (they bound no local job)
    parser.add_argument("--timeout", type=seconds, default=None, help="deadline of each call in seconds (default 60)")
    parser.add_argument("--connect-timeout", type=seconds, default=None,
                        help=f"how long to wait for the server to come up (default {connect_timeout:g} s)")
    parser.set_defaults(default_connect_timeout=connect_timeout)
    parser.add_argument("--tls-ca", type=Path, default=None, help="PEM CA of the server's certificate (TLS)")
    parser.add_argument("--tls-cert", type=Path, default=None, help="PEM client certificate (mTLS)")
    parser.add_argument("--tls-key", type=Path, default=None, help="PEM key of --tls-cert")
    parser.add_argument("--token-file", type=Path, default=None,
                        help="file holding the bearer token (default: $OSSCAR_TOKEN)")


