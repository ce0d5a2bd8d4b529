"""Server reflection through both protocols, v1alpha and v1, against a real `osscar serve`."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_grpc

from service.api import reflection_v1

from ..server_process import ServerProcess

EXPECTED = {"osscar.compression.v1.Compression", "google.longrunning.Operations", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("reflection") / "home").start()
    yield process
    assert process.stop() == 0


def _v1(channel: grpc.Channel, *requests):
    request_class, response_class = reflection_v1.message_classes()
    call = channel.stream_stream(reflection_v1.METHOD, request_serializer=request_class.SerializeToString,
                                 response_deserializer=response_class.FromString)
    return list(call(iter([request_class(**r) for r in requests]), timeout=20))


def test_services_are_listed_through_v1alpha(server):
    stub = v1alpha_grpc.ServerReflectionStub(server.channel)
    (reply,) = stub.ServerReflectionInfo(iter([v1alpha_pb2.ServerReflectionRequest(list_services="")]), timeout=20)
    assert {s.name for s in reply.list_services_response.service} == EXPECTED


def test_services_are_listed_through_v1(server):
    (reply,) = _v1(server.channel, {"list_services": ""})
    assert type(reply).DESCRIPTOR.full_name == "grpc.reflection.v1.ServerReflectionResponse"
    assert {s.name for s in reply.list_services_response.service} == EXPECTED


def test_v1_describes_our_service_and_itself(server):
    ours, itself, missing = _v1(server.channel, {"file_containing_symbol": "osscar.compression.v1.Compression"},
                                {"file_containing_symbol": reflection_v1.SERVICE_NAME},
                                {"file_containing_symbol": "no.such.Service"})
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in ours.file_descriptor_response.file_descriptor_proto]
    assert any(f.package == "osscar.compression.v1" and f.service[0].name == "Compression" for f in files)
    (v1_file,) = [descriptor_pb2.FileDescriptorProto.FromString(b)
                  for b in itself.file_descriptor_response.file_descriptor_proto]
    assert v1_file.name == "grpc/reflection/v1/reflection.proto" and v1_file.package == "grpc.reflection.v1"
    assert v1_file.service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
