"""Server reflection that carries the proto comments, so the API documents itself through grpcurl.

grpcio-reflection answers with each file as ``FileDescriptor.CopyToProto`` writes it, and the
descriptors the generated ``*_pb2`` modules register hold no source info: ``grpcurl describe``
would show fields without their comments (that ``max_tokens`` defaults to 256, that temperature 0
is greedy). ``scripts/gen_protos.sh`` also writes ``stageserve/v1/descriptors.binpb``, the same
files as a ``FileDescriptorSet`` with their source info; :class:`SourceInfoPool` hands
grpcio-reflection the process's default pool with those files' ``CopyToProto`` answering from that
set, comments included. Files outside it (health, reflection itself) are served as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from importlib import resources
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool

DESCRIPTOR_SET = "descriptors.binpb"  # in the stageserve.v1 package, next to the generated stubs


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
