"""Server reflection ``grpc.reflection.v1`` beside ``v1alpha``: newer tools ask for v1 only.

``grpcio-reflection`` serves only ``grpc.reflection.v1alpha.ServerReflection``. The v1 protocol is
the same file under another package (``grpc/reflection/v1/reflection.proto``: same messages,
same field numbers, so the same bytes on the wire). So v1 is served by the same servicer class,
its messages parsed and written with the v1alpha classes, under the v1 service name; the v1 file is
registered in the descriptor pool (built from the v1alpha one, package renamed), so reflection
describes it like any other service.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import _async, reflection, reflection_pb2

V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
_V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"


def _register_v1_file(pool: descriptor_pool.DescriptorPool) -> None:
    """Add ``grpc/reflection/v1/reflection.proto`` to ``pool`` (once), made from the v1alpha file."""
    try:
        pool.FindServiceByName(V1_SERVICE_NAME)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", V1_PACKAGE
    old, new = f".{_V1ALPHA_PACKAGE}.", f".{V1_PACKAGE}."
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new)
    for method in proto.service[0].method:
        method.input_type, method.output_type = method.input_type.replace(old, new), method.output_type.replace(old, new)
    pool.AddSerializedFile(proto.SerializeToString())


def enable_reflection_v1(service_names: Sequence[str], server: grpc.Server | grpc.aio.Server,
                         pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """Serve ``grpc.reflection.v1.ServerReflection`` on ``server`` (sync or ``grpc.aio``), listing
    ``service_names`` and describing the files of ``pool`` (default: the default pool), as the
    v1alpha service does."""
    _register_v1_file(descriptor_pool.Default())
    servicer_class = _async.ReflectionServicer if isinstance(server, grpc.aio.Server) else reflection.ReflectionServicer
    servicer = servicer_class(list(service_names), pool=pool)
    handler = grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        ),
    })
    server.add_generic_rpc_handlers((handler,))
