"""The error interceptor in process (and the generated API modules it speaks)."""

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2

from service import errors
from service.api.wire import api_description, error_details
from service.server.interceptors import ErrorInterceptor, status_of

ROOT = Path(__file__).resolve().parents[3]


def test_generated_modules_match_the_proto():
    result = subprocess.run([sys.executable, "proto/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_domain_errors_map_to_aip193_statuses():
    bad = status_of(errors.InvalidArgument([errors.FieldViolation("samples", "--samples must be >= 1 (got 0)")]))
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    violation = error_details_pb2.BadRequest()
    bad.details[0].Unpack(violation)
    assert violation.field_violations[0].field == "options.samples"
    assert violation.field_violations[0].description == "options.samples must be >= 1 (got 0)"
    full = status_of(errors.ResourceExhausted("queue full", 12.5))
    retry = error_details_pb2.RetryInfo()
    full.details[0].Unpack(retry)
    assert full.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and retry.retry_delay.ToMilliseconds() == 12500
    assert api_description("--uniform-ratio and --sequence-length") == "uniform_ratio and options.sequence_length"


def test_echoed_input_is_clipped_under_the_trailer_limit():
    echo = "𝔘" * 4000  # 4 UTF-8 bytes each, percent-encoded to 12 on the wire
    many = errors.InvalidArgument([errors.FieldViolation(f"labels[k{i}]", f"bad {echo}") for i in range(64)])
    for err in (many, errors.NotFound("model", echo, f"no such model: {echo}")):
        status = status_of(err)
        wire = 3 * len(status.message.encode()) + 4 * len(status.SerializeToString()) // 3  # message + base64
        assert wire < 12_000, wire
    assert "and 54 more" in status_of(many).message


def test_a_violation_of_a_few_hundred_characters_is_whole_in_the_message():
    """A client that reads only the status message (one built by reflection) gets each refusal's whole line,
    not a cut one; the BadRequest detail carries the same."""
    why = "--decode-step: " + "gemma2's sliding-window layers keep a window of keys in their cache " * 3
    status = status_of(errors.InvalidArgument([errors.FieldViolation("decode_step", why.strip())]))
    assert api_description(why.strip()) in status.message and len(status.message) > 200


class _Failing(grpc.GenericRpcHandler):
    def service(self, details):
        async def boom(request, context):
            raise RuntimeError("secret path /srv/models/customer-x")

        async def refused(request, context):
            raise errors.FailedPrecondition("UNSUPPORTED_ARCHITECTURE", "not supported", {"model_type": "x"})

        behaviour = boom if details.method.endswith("Boom") else refused
        return grpc.unary_unary_rpc_method_handler(behaviour)


def test_unknown_errors_are_internal_without_their_text_and_domain_errors_keep_details():
    async def main():
        server = grpc.aio.server(interceptors=[ErrorInterceptor()])
        server.add_generic_rpc_handlers((_Failing(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                results = []
                for method in ("/t.T/Boom", "/t.T/Refused"):
                    try:
                        await channel.unary_unary(method)(b"", timeout=10)
                    except grpc.aio.AioRpcError as err:
                        results.append(err)
                return results
        finally:
            await server.stop(None)

    internal, refused = asyncio.run(main())
    assert internal.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in internal.details() and "customer" not in internal.details()
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_details(refused)["error_info"]
    assert info.reason == "UNSUPPORTED_ARCHITECTURE" and info.metadata["model_type"] == "x"


@pytest.mark.parametrize("bad", ["--", "x --"])
def test_api_description_leaves_non_flags_alone(bad):
    assert api_description(bad) == bad
