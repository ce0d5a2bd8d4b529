"""The `osscar` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .terminal import ProgressLines


def _demo(args: argparse.Namespace) -> int:
    from .demo import format_table, run_demo

    print(f"Pruning {args.ratio:.0%} of the heads and FFN neurons of every layer of "
          f"{args.model or 'all-MiniLM-L6-v2 (embedded)'}, layer by layer;\n"
          "relative output error ||X (W_hat - W)||^2 / ||X W_hat||^2 per method (lower is better):\n",
          file=sys.stderr)
    print(format_table(run_demo(args.ratio, args.model)))
    return 0


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


class _Progress:
    """Stage lines as they come; per-layer lines are transient (redrawn in place on a terminal)."""

    def __init__(self, stream) -> None:
        self.lines = ProgressLines(stream)

    def __call__(self, message: str) -> None:
        self.lines(message, transient=message.startswith("[") or "relative error" in message)


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _compress(args: argparse.Namespace) -> int:
    if args.server:
        from .client import remote_compress

        return remote_compress(args)
    from .compress import CompressRequest, compress, default_home
    from .references import embedded

    for name in ("model", "calibration", "eval"):  # embedded:<name> works locally too
        value = getattr(args, name)
        if value is not None and str(value).startswith("embedded:"):
            setattr(args, name, embedded(str(value), default_home()))
    request = CompressRequest(
        model=str(args.model), uniform_ratio=args.uniform_ratio, target_speedup=args.target_speedup,
        widths_from=args.widths_from,
        calibration=args.calibration, eval=args.eval, out_dir=args.out, method=args.method, samples=args.samples,
        seed=args.seed, mean=args.mean, std=args.std, device=args.device, batch_size=args.batch_size,
        sequences=args.sequences, sequence_length=args.sequence_length, stream=args.stream,
        activation_dtype=args.activation_dtype, shape=args.shape or {}, execution_provider=args.execution_provider,
        threads=args.threads, deployment_target=args.deployment_target, round_to=args.round_to,
        min_width=args.min_width, max_rounds=args.max_rounds, accuracy_budget=args.accuracy_budget,
        back_off=args.back_off, repeats=args.repeats, opset=args.opset, precision=args.precision,
        decode_step=args.decode_step,
        **({"curves_cache": None} if args.no_curves_cache else {}))
    progress = _Progress(sys.stderr)
    report = compress(request, progress=progress)
    if report["status"] != "ok":
        print(f"osscar: {report['status']}: measured speedup {report['measured_speedup']:.3f}x "
              f"(target {report['target_speedup']}), {report['metric']['name']} {report['metric']['baseline']:.4f}"
              f" -> {report['metric']['compressed']:.4f}; the best artifact and report are in {args.out}",
              file=sys.stderr)
        return 2
    return 0


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if args.tls_ca:
        channel = grpc.secure_channel(args.server, grpc.ssl_channel_credentials(args.tls_ca.read_bytes()))
    else:
        channel = grpc.insecure_channel(args.server)
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


SERVE_FLAGS = ("host", "port", "home", "max_queue", "devices", "max_attempts", "retention_days", "grace_s",
               "insecure", "tls_cert", "tls_key", "tls_client_ca", "tokens_file", "allowed_roots", "allowed_schemes",
               "trust_remote_code", "max_upload_mb", "max_message_mb", "max_concurrent_rpcs", "metrics_port",
               "log_format", "health_port")


def _serve(args: argparse.Namespace) -> int:
    import pydantic

    from .grpc_server import Server, serve
    from .logs import configure
    from .settings import ServerSettings

    given = {name: getattr(args, name) for name in SERVE_FLAGS
             if getattr(args, name) is not None and getattr(args, name) is not False}
    try:  # flags override OSSCAR_* environment variables
        settings = ServerSettings(**given)
    except pydantic.ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg'].removeprefix('Value error, ')}"
                             for e in err.errors())
        raise ValueError(problems) from None
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

    serve(settings, ready)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="osscar", description="One-shot structured pruning (OSSCAR).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compare the layer solvers on a real model (no downloads)")
    demo.add_argument("--ratio", type=float, default=0.5, help="fraction of groups pruned per layer")
    demo.add_argument("--model", type=Path, default=None,
                      help="a local BERT-like HF model directory (default: the embedded all-MiniLM-L6-v2)")
    demo.set_defaults(func=_demo)

    from compressor.calibration import IMAGENET_MEAN, IMAGENET_STD

    comp = sub.add_parser("compress", help="prune a model physically and export it to ONNX")
    comp.add_argument("model", help="a .pt2 torch.export program, a Hugging Face model directory or cached hub "
                      "id, or torchvision:<name>")
    mode = comp.add_mutually_exclusive_group(required=True)
    mode.add_argument("--target-speedup", type=float, help="measured speedup to reach in ONNX Runtime (e.g. 1.5)")
    mode.add_argument("--uniform-ratio", type=float,
                      help="fraction of each prunable layer's channels removed (rounded, >= 1 kept): the paper's "
                      "protocol, one round")
    mode.add_argument("--widths-from", type=Path,
                      help="the per-layer widths of an earlier report.json (e.g. to compare methods at equal widths)")
    comp.add_argument("--calibration", type=Path, required=True,
                      help="images: .npz with x uint8 NHWC, or .npy float32 NCHW used as-is; text (transformers): "
                      ".txt/.jsonl through the model's tokenizer, or token ids as .npz (ids, offsets) / .npy")
    comp.add_argument("--eval", type=Path, default=None,
                      help="evaluation data: images .npz with labels y (top-1), token ids / text (perplexity for "
                      "LMs); default: held-out calibration-like data (cosine to the dense outputs, perplexity)")
    comp.add_argument("--method", default="osscar", choices=("osscar", "mp", "mp+", "thinet"))
    comp.add_argument("--out", type=Path, required=True, help="output directory")
    comp.add_argument("--samples", type=int, default=500, help="calibration images drawn (default 500)")
    comp.add_argument("--seed", type=int, default=0, help="seed of the calibration draw")
    comp.add_argument("--mean", type=_floats, default=IMAGENET_MEAN, help="per-channel mean for .npz images")
    comp.add_argument("--std", type=_floats, default=IMAGENET_STD, help="per-channel std for .npz images")
    comp.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    comp.add_argument("--batch-size", type=int, default=100, help="calibration batch size (images)")
    comp.add_argument("--sequences", type=int, default=128, help="text calibration: sequences drawn (default 128)")
    comp.add_argument("--sequence-length", type=int, default=128, help="text calibration: tokens per sequence")
    comp.add_argument("--stream", action="store_true",
                      help="transformers: read one block at a time from the safetensors shards and write it back "
                      "pruned (memory bounded by a block, for models larger than RAM)")
    comp.add_argument("--activation-dtype", default="float32", choices=("float32", "float16"),
                      help="transformers: dtype of the calibration activations kept on the CPU between blocks")
    comp.add_argument("--shape", type=_shape, default=None,
                      help="measured input shape: batch=N[,sequence=N] (defaults: images batch=64; encoders "
                      "batch=8,sequence=128; decoders batch=1,sequence=512)")
    comp.add_argument("--execution-provider", choices=("cpu", "cuda"), default=None,
                      help="ONNX Runtime provider for measurement (default: cuda when available)")
    comp.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads (default: cores available)")
    comp.add_argument("--deployment-target", choices=("cpu", "cuda"), default=None,
                      help="where the model will be served; a warning when measurement runs elsewhere")
    comp.add_argument("--round-to", type=int, default=8, help="target mode: widths in multiples of this (default 8)")
    comp.add_argument("--min-width", type=float, default=0.1,
                      help="target mode: minimum kept fraction of every layer (default 0.1)")
    comp.add_argument("--max-rounds", type=int, default=4, help="target mode: prune-measure rounds at most")
    comp.add_argument("--accuracy-budget", type=float, default=None,
                      help="maximum relative drop of the metric (e.g. 0.02)")
    comp.add_argument("--back-off", action="store_true",
                      help="with --accuracy-budget: return the largest measured speedup that meets it")
    comp.add_argument("--repeats", type=int, default=20, help="latency runs per model (median and p90)")
    comp.add_argument("--opset", type=int, default=18, help="ONNX opset of the export (default 18)")
    comp.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                      help="compute precision of the exports, dense baseline included; inputs and outputs stay "
                      "float32 (default fp32)")
    comp.add_argument("--decode-step", action="store_true",
                      help="causal LMs: also export decode.onnx, one token with past key/values per layer")
    comp.add_argument("--no-curves-cache", action="store_true",
                      help="target mode: recompute the dense loss curves instead of reusing $OSSCAR_HOME/curves")
    remote = comp.add_argument_group("through a server (osscar serve)")
    remote.add_argument("--server", metavar="HOST:PORT", default=None,
                        help="run the job on an osscar server; outputs are downloaded into --out")
    remote.add_argument("--upload", action="store_true",
                        help="upload the model and data (directories as tar) instead of sending their paths")
    remote.add_argument("--request-id", default=None,
                        help="idempotency key (a UUID; default: a new one): resubmitting it returns the same job")
    remote.add_argument("--label", type=_label, action="append", metavar="KEY=VALUE", help="a label on the job")
    remote.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="wall-clock budget of the job on the server")
    remote.add_argument("--timeout", type=float, default=60.0, help="deadline of each call in seconds (default 60)")
    remote.add_argument("--connect-timeout", type=float, default=60.0,
                        help="how long to wait for the server to come up (default 60 s)")
    remote.add_argument("--tls-ca", type=Path, default=None, help="PEM CA of the server's certificate (TLS)")
    remote.add_argument("--tls-cert", type=Path, default=None, help="PEM client certificate (mTLS)")
    remote.add_argument("--tls-key", type=Path, default=None, help="PEM key of --tls-cert")
    remote.add_argument("--token-file", type=Path, default=None,
                        help="file holding the bearer token (default: $OSSCAR_TOKEN)")
    comp.set_defaults(func=_compress)

    serve = sub.add_parser("serve", help="run the gRPC compression service",
                           description="Every flag has an OSSCAR_<NAME> environment variable (flags win); bearer "
                           "tokens come from OSSCAR_TOKENS or --tokens-file, never from the command line.")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, help="port (default 50051; 0 picks a free one)")
    serve.add_argument("--home", type=Path, help="jobs, artifacts and caches (default $OSSCAR_HOME, else ~/.osscar)")
    serve.add_argument("--max-queue", type=int, help="queued jobs before RESOURCE_EXHAUSTED (16)")
    serve.add_argument("--devices", help="comma-separated device slots, one job each (default: every CUDA device, "
                       "else cpu)")
    serve.add_argument("--max-attempts", type=int, help="runs of a job interrupted by server restarts before it "
                       "fails (3)")
    serve.add_argument("--retention-days", type=float, help="finished jobs and unused uploads are deleted after "
                       "this many days (30)")
    serve.add_argument("--grace", dest="grace_s", type=float, help="seconds running jobs get on shutdown before "
                       "they are re-queued (30)")
    serve.add_argument("--insecure", action="store_true", help="allow binding a non-loopback address without TLS "
                       "and authentication")
    serve.add_argument("--tls-cert", type=Path, help="PEM server certificate chain (with --tls-key: TLS)")
    serve.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    serve.add_argument("--tls-client-ca", type=Path, help="PEM CA that client certificates must chain to (mTLS)")
    serve.add_argument("--tokens-file", type=Path, help="bearer tokens, one per line")
    serve.add_argument("--allowed-roots", help="comma-separated directories path references must resolve inside")
    serve.add_argument("--allowed-schemes", help="reference kinds accepted: path,blob,embedded (default all)")
    serve.add_argument("--trust-remote-code", help="comma-separated model directories allowed to run their own code")
    serve.add_argument("--max-upload-mb", type=int, help="largest upload in MiB (65536)")
    serve.add_argument("--max-message-mb", type=int, help="largest gRPC message in MiB (8)")
    serve.add_argument("--max-concurrent-rpcs", type=int, help="RPCs in flight before RESOURCE_EXHAUSTED (1000)")
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0: a free one)")
    serve.add_argument("--log-format", choices=("json", "text"), help="server log lines (default json)")
    serve.add_argument("--health-port", type=int, help="also answer plaintext health checks on 127.0.0.1:PORT")
    serve.set_defaults(func=_serve)

    check = sub.add_parser("health", help="ask a server's grpc.health.v1 service; exit 0 when SERVING")
    check.add_argument("--server", default="127.0.0.1:50051", metavar="HOST:PORT")
    check.add_argument("--service", default="", help="service name (default: the whole server)")
    check.add_argument("--tls-ca", type=Path, default=None, help="PEM CA of the server's certificate (TLS)")
    check.add_argument("--timeout", type=float, default=5.0)
    check.set_defaults(func=_health)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:  # bad input: one line, no traceback
        print(f"osscar: error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
