"""Server reflection `grpc.reflection.v1` beside `grpc.reflection.v1alpha`.

grpcio-reflection ships only v1alpha. The v1 protocol is the same messages (same fields and numbers)
under the package `grpc.reflection.v1` (file `grpc/reflection/v1/reflection.proto`), so:

- its file descriptor is v1alpha's with the package and type references renamed, added to a descriptor
  pool on demand (`descriptor()`), so that reflection can describe the v1 service itself;
- the server side is grpcio-reflection's own servicer behind the v1 method path: the request and response
  bytes are identical, so v1alpha's (de)serialisers read and write them;
- `message_classes()` gives real v1 message classes for a client (tests use them).
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

PACKAGE = "grpc.reflection.v1"
FILE_NAME = "grpc/reflection/v1/reflection.proto"
SERVICE_NAME = f"{PACKAGE}.ServerReflection"
METHOD = f"/{SERVICE_NAME}/ServerReflectionInfo"
_ALPHA = v1alpha_pb2.DESCRIPTOR.package  # grpc.reflection.v1alpha


def file_descriptor_proto() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's file descriptor renamed to v1 (package, file name and every type reference)."""
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = FILE_NAME, PACKAGE
    proto.ClearField("options")  # java/go package options name the v1alpha packages
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(f".{_ALPHA}."):
                field.type_name = f".{PACKAGE}." + field.type_name.removeprefix(f".{_ALPHA}.")
    for service in proto.service:
        for method in service.method:
            method.input_type = f".{PACKAGE}." + method.input_type.rsplit(".", 1)[1]
            method.output_type = f".{PACKAGE}." + method.output_type.rsplit(".", 1)[1]
    return proto


def descriptor(pool: descriptor_pool.DescriptorPool | None = None):
    """The v1 file descriptor in `pool` (the default pool), added the first time."""
    pool = pool or descriptor_pool.Default()
    try:
        return pool.FindFileByName(FILE_NAME)
    except KeyError:
        pool.Add(file_descriptor_proto())
        return pool.FindFileByName(FILE_NAME)


def message_classes(pool: descriptor_pool.DescriptorPool | None = None) -> tuple[type, type]:
    """(ServerReflectionRequest, ServerReflectionResponse) of the v1 package."""
    file = descriptor(pool)
    return (message_factory.GetMessageClass(file.message_types_by_name["ServerReflectionRequest"]),
            message_factory.GetMessageClass(file.message_types_by_name["ServerReflectionResponse"]))


def enable_server_reflection(service_names, server: grpc.aio.Server) -> None:
    """Reflection v1alpha and v1 on `server`, each listing `service_names` and both reflection services."""
    descriptor()
    names = (*service_names, v1alpha.SERVICE_NAME, SERVICE_NAME)
    v1alpha.enable_server_reflection(names, server)
    handler = grpc.stream_stream_rpc_method_handler(
        v1alpha.aio.ReflectionServicer(names).ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString)
    methods = {"ServerReflectionInfo": handler}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, methods),))
