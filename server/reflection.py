"""Server reflection in both versions: ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

grpcio-reflection serves v1alpha only, and newer clients (grpc-js's reflection, recent tools) ask
v1 and stop at UNIMPLEMENTED. v1's messages are v1alpha's, field for field and number for number
(only the package differs), so one servicer answers both: the v1 service's handler reads and
writes v1alpha's classes, which put the same bytes on the wire. So that v1 describes itself too,
its file is added to the descriptor pool: v1alpha's file under v1's name and package.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _v1_file(pool: descriptor_pool.DescriptorPool) -> None:
    """Add v1's file to ``pool`` (once): v1alpha's, with every name in v1's package."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    v1 = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(v1)
    old, new = f".{v1.package}.", ".grpc.reflection.v1."
    v1.name, v1.package = _V1_FILE, "grpc.reflection.v1"
    v1.ClearField("options")  # v1alpha's language options name v1alpha's packages
    for message in v1.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # a message field's type (set only on those)
                field.type_name = field.type_name.replace(old, new)
    for method in v1.service[0].method:
        method.input_type = method.input_type.replace(old, new)
        method.output_type = method.output_type.replace(old, new)
    pool.Add(v1)


def add_reflection(service_names, server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` and both."""
    _v1_file(descriptor_pool.Default())
    servicer = reflection.aio.ReflectionServicer((*service_names, *SERVICE_NAMES))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": handler}),)
    )
