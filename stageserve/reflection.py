"""Server reflection, ``grpc.reflection.v1`` and ``v1alpha``, carrying the proto comments, so the API
documents itself through grpcurl (`enable_reflection`).

Comments. grpcio-reflection answers with each file as ``FileDescriptor.CopyToProto`` writes it, and the
descriptors the generated ``*_pb2`` modules register hold no source info: ``grpcurl describe``
would show fields without their comments (that ``max_tokens`` defaults to 256, that temperature 0
is greedy). ``scripts/gen_protos.sh`` also writes ``stageserve/v1/descriptors.binpb``, the same
files as a ``FileDescriptorSet`` with their source info; :class:`SourceInfoPool` hands
grpcio-reflection the process's default pool with those files' ``CopyToProto`` answering from that
set, comments included. Files outside it (health, reflection itself) are served as before.

v1 beside v1alpha: newer tools ask for v1 only, and ``grpcio-reflection`` serves only
``grpc.reflection.v1alpha.ServerReflection``. The v1 protocol is the same file under another
package (``grpc/reflection/v1/reflection.proto``: same messages, same field numbers, so the same
bytes on the wire). So v1 is served by the same servicer class, its messages parsed and written
with the v1alpha classes, under the v1 service name; the v1 file is registered in the descriptor
pool (built from the v1alpha one, package renamed), so reflection describes it like any other
service.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import cache
from importlib import resources
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import _async, reflection, reflection_pb2

DESCRIPTOR_SET = "descriptors.binpb"  # in the stageserve.v1 package, next to the generated stubs
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
_V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"


def enable_reflection(service_names: Sequence[str], server: grpc.Server | grpc.aio.Server) -> None:
    """Serve reflection v1alpha and v1 on ``server`` (sync or ``grpc.aio``), listing ``service_names``
    and both reflection services, stageserve's files with their comments (`SourceInfoPool`).

    Raises:
        FileNotFoundError: the package lacks the descriptor set (run ``make protos``).
    """
    names = [*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME]
    pool = SourceInfoPool()
    reflection.enable_server_reflection(names, server, pool)
    _register_v1_file(descriptor_pool.Default())
    servicer_class = _async.ReflectionServicer if isinstance(server, grpc.aio.Server) else reflection.ReflectionServicer
    servicer = servicer_class(names, pool=pool)
    handler = grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        ),
    })
    server.add_generic_rpc_handlers((handler,))


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


@cache
def documented_files() -> dict[str, descriptor_pb2.FileDescriptorProto]:
    """stageserve's ``.proto`` files by name, with their source info (comments).

    Otherwise as the generated stubs register them: protoc's descriptor set also names each
    field's ``json_name``, which the stubs leave out; it is dropped, so grpcurl keeps printing the
    proto field names (``finish_reason``, not ``finishReason``).

    Raises:
        FileNotFoundError: the package lacks the descriptor set (run ``make protos``).
    """
    data = resources.files("stageserve.v1").joinpath(DESCRIPTOR_SET).read_bytes()
    files = descriptor_pb2.FileDescriptorSet.FromString(data).file
    for file in files:
        for message in _all_messages(file.message_type):
            for field in message.field:
                field.ClearField("json_name")
    return {file.name: file for file in files}


def _all_messages(messages) -> Iterator[descriptor_pb2.DescriptorProto]:
    for message in messages:
        yield message
        yield from _all_messages(message.nested_type)


class _DocumentedFile:
    """A file descriptor of the default pool whose ``CopyToProto`` includes its source info."""

    def __init__(self, descriptor: Any, documented: dict[str, descriptor_pb2.FileDescriptorProto]) -> None:
        self._descriptor, self._documented = descriptor, documented

    @property
    def name(self) -> str:
        return self._descriptor.name

    @property
    def dependencies(self) -> list[Any]:
        return [_wrap(dependency, self._documented) for dependency in self._descriptor.dependencies]

    def CopyToProto(self, proto: descriptor_pb2.FileDescriptorProto) -> None:  # noqa: N802 (protobuf's name)
        proto.CopyFrom(self._documented[self.name])


def _wrap(descriptor: Any, documented: dict[str, descriptor_pb2.FileDescriptorProto]) -> Any:
    return _DocumentedFile(descriptor, documented) if descriptor.name in documented else descriptor


class SourceInfoPool:
    """The lookups grpcio-reflection makes (``pool=`` of ``enable_server_reflection``), answered by
    the default descriptor pool; stageserve's files come back with their comments."""

    def __init__(self) -> None:
        self._pool = descriptor_pool.Default()
        self._documented = documented_files()

    def FindFileByName(self, name: str) -> Any:  # noqa: N802 (DescriptorPool's names)
        return _wrap(self._pool.FindFileByName(name), self._documented)

    def FindFileContainingSymbol(self, symbol: str) -> Any:  # noqa: N802
        return _wrap(self._pool.FindFileContainingSymbol(symbol), self._documented)

    def FindMessageTypeByName(self, name: str) -> Any:  # noqa: N802
        return self._pool.FindMessageTypeByName(name)

    def FindExtensionByNumber(self, message: Any, number: int) -> Any:  # noqa: N802
        return self._pool.FindExtensionByNumber(message, number)

    def FindAllExtensions(self, message: Any) -> Any:  # noqa: N802
        return self._pool.FindAllExtensions(message)
