"""The `osscar` command line."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import signal
import sys
import threading
import types
import typing
from pathlib import Path
from typing import Any

from compressor.errors import InputError

from ..files import JOB_OUTPUTS, hold_folder
from .options import add_connection_flags, add_request_flags, compress_options, label_flag, seconds
from .terminal import JobProgress, ignoring_interrupts

log = logging.getLogger(__name__)


def _demo(args: argparse.Namespace) -> int:
    from .demo import check_model_dir, check_ratio, format_table, run_demo

    check_ratio(args.ratio)  # before the header: a bad flag is one line
    if args.model is not None:
        check_model_dir(args.model)
    print(f"Pruning {args.ratio:.0%} of the heads and FFN neurons of every layer of "
          f"{args.model or 'all-MiniLM-L6-v2 (embedded)'}, layer by layer;\n"
          "relative output error ||X (W_hat - W)||^2 / ||X W_hat||^2 per method (lower is better):\n",
          file=sys.stderr)
    print(format_table(run_demo(args.ratio, args.model)))
    return 0



SCRATCH_PREFIX = ".osscar-work-"


def _stamp(path: Path) -> tuple:
    """Changes when a file or anything under a directory is written, replaced or removed."""
    stat = path.lstat()
    stamp = [(stat.st_ino, stat.st_mtime_ns, stat.st_size)]
    if path.is_dir() and not path.is_symlink():
        stamp += sorted((str(p.relative_to(path)), p.lstat().st_ino, p.lstat().st_mtime_ns, p.lstat().st_size)
                        for p in path.rglob("*"))
    return tuple(stamp)


class WrittenOutputs:
    """What a local run writes into its output directory, to take back when it is interrupted: the
    directory itself if the run created it; otherwise the job's outputs that are new or changed since the
    run began (an earlier run's outputs it never touched stay, and so does anything that is not a job
    output)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.created = not out.exists()
        self.before = {} if self.created else \
            {p.name: _stamp(p) for p in out.iterdir() if p.name in JOB_OUTPUTS}

    def undo(self) -> str:
        """Remove them; returns what was done, in words."""

        if self.created:
            shutil.rmtree(self.out, ignore_errors=True)
            return f"removed {self.out} (this run created it)" if not self.out.exists() else \
                f"could not remove all of {self.out}"
        removed = []
        for path in sorted(self.out.iterdir()) if self.out.is_dir() else []:
            ours = path.name in JOB_OUTPUTS or path.name.startswith(SCRATCH_PREFIX)
            if ours and (path.name not in self.before or self.before[path.name] != _stamp(path)):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(path.name)
        return f"removed what this run wrote in {self.out} ({', '.join(removed)})" if removed else \
            f"nothing of this run was left in {self.out}"


# flags that only mean something with --server (their defaults: not given)
REMOTE_ONLY = {"upload": False, "request_id": None, "label": None, "cancel_on_interrupt": False, "tls_ca": None,
               "tls_cert": None, "tls_key": None, "token_file": None, "timeout": None, "connect_timeout": None}


def _compress(args: argparse.Namespace) -> int:
    if args.server:
        from .remote import remote_compress

        return remote_compress(args)
    given = [f"--{name.replace('_', '-')}" for name, default in REMOTE_ONLY.items() if getattr(args, name) != default]
    if given:  # silently running locally would, e.g., read the paths an --upload was meant to send
        print(f"osscar: error: {', '.join(given)} only with --server (this job would run here)", file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        print(f"osscar: error: --out {out} is a file; give a folder (new or one of an earlier job's)", file=sys.stderr)
        return 2
    from ..embedded import embedded
    from ..files import default_home

    options = compress_options(args)
    if args.time_budget is not None:  # the job paces its reconstruction to it, as on a server
        options["time_budget"] = args.time_budget
    given = {name: str(options[name]) for name in ("model", "calibration", "eval", "widths_from")
             if options.get(name) is not None}
    for name in ("model", "calibration", "eval"):  # embedded:<name> works locally too
        value = options.get(name)
        if value is not None and str(value).startswith("embedded:"):
            options[name] = embedded(str(value), default_home())
    options["model"] = str(options["model"])
    written = WrittenOutputs(out)
    # --out is held for the whole job: two jobs into one folder replaced and removed each other's files, and an
    # interrupted one took back the other's
    try:
        held = hold_folder(out, wait=False)
    except OSError as err:
        print(f"osscar: error: --out {out}: {err.strerror or err}", file=sys.stderr)
        return 2
    if held is None:
        print(f"osscar: error: another osscar command is writing into {out} (a job or a download); wait for it to end "
              "or give another --out", file=sys.stderr)
        return 2
    # local jobs take turns timing ONNX Runtime with each other and with a server's jobs on this machine, as those do
    turns = "OSSCAR_LATENCY_LOCK" not in os.environ
    if turns:
        os.environ["OSSCAR_LATENCY_LOCK"] = str(default_home() / "latency.lock")
    try:
        return _run_local(args, options, given, written)
    finally:
        if turns:
            os.environ.pop("OSSCAR_LATENCY_LOCK", None)
        os.close(held)  # releases the folder
        if written.created:  # a folder this run made and left empty (a refusal before anything was written)
            with contextlib.suppress(OSError):
                out.rmdir()


def _gpus_seen() -> int:
    """The GPUs this process may use, counted without starting CUDA (which would fix what it sees before
    CUDA_VISIBLE_DEVICES is set): that variable's list where it is set, else the NVIDIA driver's GPUs."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return len([d for d in listed.split(",") if d.strip()])
    with contextlib.suppress(OSError):
        return len(list(Path("/proc/driver/nvidia/gpus").iterdir()))
    return 0


def _run_local(args: argparse.Namespace, options: dict[str, Any], given: dict[str, str],
               written: WrittenOutputs) -> int:
    """The local job in `--out`, which this process holds."""
    from ..core.outcomes import JobError, out_of_disk, out_of_memory
    from ..job import CompressRequest, compress
    from ..job.report_html import record_references

    progress = JobProgress(sys.stderr)
    current = {"stage": "loading"}
    device = options.get("device") or ""
    if re.fullmatch(r"cuda:\d{1,2}", device) and int(device[5:]) < _gpus_seen():  # else the request's check says
        from ..core.worker import visible_device

        # ONNX Runtime's CUDA provider takes device 0: `--device cuda:1` pruned on GPU 1 and timed on GPU 0 (a GPU
        # that is not there stays as asked, for the job's own check to name it)
        options = {**options, "device": visible_device(options["device"])}
    try:
        report = compress(CompressRequest(**options), progress=progress,
                          stage=lambda name, _index: current.update(stage=name))
        report = record_references(Path(args.out_dir), report, given)  # report.html's title: as given
    except KeyboardInterrupt:
        with ignoring_interrupts():  # a second Ctrl-C must not stop the clean-up half-way
            progress.lines.end()
            print(f"osscar: interrupted; {written.undo()}", file=sys.stderr)
        return 130
    except Exception as err:  # memory or disk space running out is the machine's, not a bug: one line, exit 2
        if out_of_memory(err) is None and out_of_disk(err) is None:
            raise
        progress.lines.end()
        message = JobError.from_exception(err, stage=current["stage"]).message
        print(f"osscar: {message}; {written.undo()}", file=sys.stderr)
        return 2
    if report.status in ("parity_failed", "evaluation_failed"):
        print(f"osscar: {report.message}; no model.onnx kept, the report is in {args.out_dir}", file=sys.stderr)
        return 2
    if report.status != "ok":
        print(f"osscar: {report.message}; the best artifact and report are in {args.out_dir}", file=sys.stderr)
        return 2
    return 0


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from .transport import ClientError, open_channel

    try:
        channel = open_channel(args.server, args.tls_ca, args.tls_cert, args.tls_key)
    except ClientError as err:
        print(f"osscar: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"osscar: error: {err.filename}: {err.strerror}", file=sys.stderr)
        return 2
    with channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                               timeout=args.timeout).status
        except grpc.RpcError as err:
            print(f"osscar: {args.server}: {err.code().name}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(name)
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


# flags whose name is not the field's; fields that never come from the command line (secrets)
SERVE_FLAG_NAMES = {"grace_s": "--grace"}


SERVE_NOT_FLAGS = ("tokens",)


def _serve(args: argparse.Namespace) -> int:
    import pydantic

    from ..logs import configure
    from ..server.app import Server, serve
    from ..server.settings import ServerSettings

    given = {name: getattr(args, name) for name in ServerSettings.model_fields
             if getattr(args, name, None) is not None and getattr(args, name, None) is not False}
    try:  # flags override OSSCAR_* environment variables
        settings = ServerSettings(**given)
    except pydantic.ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg'].removeprefix('Value error, ')}"
                             for e in err.errors())
        raise InputError(problems) from None
    configure(settings.log_format)

    def ready(server: Server) -> None:
        security = ("mTLS" if settings.tls_client_ca else "TLS") if settings.tls else "plaintext"
        auth = "bearer tokens" if settings.bearer_tokens() else "client certificates" if settings.tls_client_ca \
            else "no auth"
        metrics = f", metrics on {settings.host}:{server.metrics_port}" if server.metrics_port is not None else ""
        if server.health_port is not None:
            metrics += f", health on 127.0.0.1:{server.health_port}"
        print(f"osscar: serving on {settings.host}:{server.port} ({security}, {auth}; data in "
              f"{server.jobs.home}{metrics})", file=sys.stderr, flush=True)

    from exporters.runtime import default_provider

    # on a GPU node: a CUDA provider that is listed but does not load is logged loudly now, not found later
    log.info("latency measurement on %s", default_provider())
    serve(settings, ready)
    return 0


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """`osscar serve`'s flags, one per ServerSettings field (help from the field's description)."""
    from ..server.settings import ServerSettings

    for name, info in ServerSettings.model_fields.items():
        if name in SERVE_NOT_FLAGS:
            continue
        flag = SERVE_FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
        kwargs: dict[str, Any] = {"dest": name, "help": info.description}
        kind = info.annotation
        if isinstance(kind, types.UnionType):  # X | None
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if kind is bool:
            kwargs["action"] = "store_true"
        elif typing.get_origin(kind) is typing.Literal:
            kwargs["choices"] = typing.get_args(kind)
        else:
            kwargs["type"] = kind
        default = info.get_default(call_default_factory=False)
        # by identity: a default of 0 equals False, and is one to show
        if default is not None and default is not False and default != "" and info.default_factory is None:
            kwargs["help"] += f" (default {default})"
        parser.add_argument(flag, **kwargs)


def _operations(args: argparse.Namespace) -> int:
    from .operations import operations_command

    return operations_command(args)


# commands that never load a model: their parser leaves out compress's flags, whose schema (service.job.request)
# imports torch and transformers, seconds of every container health probe (`osscar health`, the image's HEALTHCHECK)
LIGHT_COMMANDS = ("health", "operations")


def build_parser(light: bool = False) -> argparse.ArgumentParser:
    """The command line's parser; `light`: without compress's flags (for LIGHT_COMMANDS)."""
    parser = argparse.ArgumentParser(prog="osscar", description="One-shot structured pruning (OSSCAR).")
    verbose_help = "also our packages' INFO logs on stderr (details beyond the progress lines)"
    parser.add_argument("-v", "--verbose", action="store_true", help=verbose_help)
    # -v after the command too (`osscar compress ... -v`); unset there, the top level's value stands
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose_help)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", parents=[common], help="compare the layer solvers on a real model (no downloads)")
    demo.add_argument("--ratio", type=float, default=0.5, help="fraction of groups pruned per layer")
    demo.add_argument("--model", type=Path, default=None,
                      help="a local BERT-like HF model directory (default: the embedded all-MiniLM-L6-v2)")
    demo.set_defaults(func=_demo)

    comp = sub.add_parser("compress", parents=[common], help="prune a model physically and export it to ONNX")
    if not light:
        add_request_flags(comp)
    remote = comp.add_argument_group("through a server (osscar serve)")
    remote.add_argument("--server", metavar="HOST:PORT", default=None,
                        help="run the job on an osscar server; outputs are downloaded into --out")
    remote.add_argument("--upload", action="store_true",
                        help="upload the model and data (directories as tar) instead of sending their paths")
    remote.add_argument("--request-id", default=None,
                        help="idempotency key (a UUID; default: a new one): resubmitting it returns the same job")
    remote.add_argument("--label", type=label_flag, action="append", metavar="KEY=VALUE", help="a label on the job")
    remote.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="wall-clock budget of the job: its reconstruction is paced to fit it (report.json "
                        "`pacing`); a server also ends the job past it")
    remote.add_argument("--cancel-on-interrupt", action="store_true",
                        help="Ctrl-C cancels the job on the server (default: it keeps running, and the commands "
                        "to follow, download or cancel it are printed)")
    add_connection_flags(remote, connect_timeout=60.0)
    comp.set_defaults(func=_compress)

    ops = sub.add_parser("operations", parents=[common], help="list, follow, cancel and download the jobs of a server")
    actions = ops.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (("list", "the server's operations, oldest first"),
                         ("get", "one operation: state, progress, error or report"),
                         ("watch", "follow an operation's progress until it ends; exit 2 if it failed"),
                         ("cancel", "cancel an operation (a running worker is stopped)"),
                         ("download", "an operation's artifacts into --out (a running one is followed first)")):
        cmd = actions.add_parser(action, parents=[common], help=text, description=text)
        if action == "list":
            cmd.add_argument("--filter", default=None,
                             help='e.g. \'state = RUNNING AND labels.team = "x"\' (fields: state, done, model, '
                             'method, labels.K)')
        else:
            cmd.add_argument("name", metavar="NAME", help="the operation's name (operations/...)")
        if action == "get":
            cmd.add_argument("--json", action="store_true", help="the Operation message as JSON")
        if action == "download":
            cmd.add_argument("--out", dest="out_dir", type=Path, required=True, metavar="DIR",
                             help="directory for the artifacts")
        cmd.add_argument("--server", default="127.0.0.1:50051", metavar="HOST:PORT",
                         help="the osscar server (default 127.0.0.1:50051)")
        add_connection_flags(cmd, connect_timeout=10.0)
        cmd.set_defaults(func=_operations)

    serve = sub.add_parser("serve", parents=[common], help="run the gRPC compression service",
                           description="Every flag has an OSSCAR_<NAME> environment variable (flags win); bearer "
                           "tokens come from OSSCAR_TOKENS or --tokens-file, never from the command line.")
    add_settings_flags(serve)
    serve.set_defaults(func=_serve)

    check = sub.add_parser("health", parents=[common],
                           help="ask a server's grpc.health.v1 service; exit 0 when SERVING")
    check.add_argument("--server", default="127.0.0.1:50051", metavar="HOST:PORT")
    check.add_argument("--service", default="", help="service name (default: the whole server)")
    check.add_argument("--tls-ca", type=Path, default=None, help="PEM CA of the server's certificate (TLS)")
    check.add_argument("--tls-cert", type=Path, default=None, help="this client's PEM certificate (mTLS)")
    check.add_argument("--tls-key", type=Path, default=None, help="this client's PEM private key (mTLS)")
    check.add_argument("--timeout", type=seconds, default=5.0)
    check.set_defaults(func=_health)
    return parser


def _configure_logging(verbose: bool) -> None:
    """Warnings of every library on stderr; with -v, our packages' progress too. Third-party loggers stay at
    WARNING: at INFO the exporter's passes wrote 15,000 lines (some with stack traces) into a SmolLM2 job's
    progress (bench/RESULTS.md, session 33)."""
    from ..logs import drop_irrelevant, set_levels

    logging.basicConfig(format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    set_levels(ours=logging.INFO if verbose else logging.WARNING, others=logging.WARNING)
    drop_irrelevant()


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    command = next((word for word in words if not word.startswith("-")), None)
    parser = build_parser(light=command in LIGHT_COMMANDS)
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    # SIGTERM (`timeout`, `docker stop`, a CI's cancel, systemd) takes Ctrl-C's path: a local job removes what it
    # wrote, --cancel-on-interrupt cancels the remote job. It killed the process with its scratch left in --out.
    # The server handles its own (a drain).
    previous = None
    if args.func is not _serve and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C where no command said more: one line, the shell's 128 + SIGINT
        print("osscar: interrupted", file=sys.stderr)
        return 130
    except (InputError, FileNotFoundError) as err:  # bad input: one line, no traceback (bugs keep theirs)
        print(f"osscar: error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())


