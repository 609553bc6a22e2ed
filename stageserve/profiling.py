"""The ``stageserve.v1.Admin`` servicer: start and stop a trace window on a running service.

Every service serves it over its own :class:`~stageserve.tracing.Tracer`. A service created with
``peers`` (prepare: its device and reclaim) forwards each call to them after acting locally, so
one ``StartProfile`` to prepare profiles the whole deployment::

    grpcurl -plaintext -d '{"name": "run1"}' localhost:50051 stageserve.v1.Admin/StartProfile
    grpcurl -plaintext localhost:50051 stageserve.v1.Admin/StopProfile

No caller-supplied value becomes a path: the caller names a folder (:func:`profile_folder`), and
each service records under its own ``--profile-dir``; a name with a separator, ``..``, a leading
dot or a symbolic link out of the folder is refused before anything is created.

Errors are gRPC statuses naming the service and what to do: ``INVALID_ARGUMENT`` (a bad name, or
the old ``trace_dir``), ``FAILED_PRECONDITION`` (already recording / not recording), ``INTERNAL``
(the folder or file cannot be written; the message names no path and no file), a peer's own status
(prefixed with its name and address) or ``UNAVAILABLE`` when a peer does not answer. A
``StartProfile`` that fails at a peer stops the windows it already started, so a failed call
leaves nothing recording.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import grpc

from stageserve.security.tls import TlsFiles, dial
from stageserve.tracing import Tracer
from stageserve.v1 import admin_pb2, admin_pb2_grpc

log = logging.getLogger(__name__)

ADMIN_SERVICE_NAME = "stageserve.v1.Admin"
PEER_TIMEOUT_S = 10.0  # a StopProfile writes the window's file, which can take seconds for a long window
_FOLDER_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")


class ProfileError(Exception):
    """A profile call failed; ``code`` and ``message`` become the RPC's status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def profile_folder(root: Path, name: str) -> Path:
    """The folder of a window called ``name`` under ``root``: ``root`` itself for ``""``.

    Raises:
        ProfileError: ``INVALID_ARGUMENT`` when ``name`` is not a plain folder name (letters, digits,
            ``._-``, 64 at most, no leading dot) or leads out of ``root`` through a symbolic link;
            the message does not say whether anything of that name exists.
    """
    if not name:
        return root
    if not _FOLDER_NAME.fullmatch(name):
        raise ProfileError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"name {name[:80]!r}: use a folder name of letters, digits and ._- (64 at most, not starting with"
                           " a dot); no paths or separators")
    folder = root / name
    if os.path.realpath(folder) != os.path.join(os.path.realpath(root), name):
        raise ProfileError(grpc.StatusCode.INVALID_ARGUMENT, f"name {name!r} cannot be used; choose another name")
    return folder


class ProfileServicer(admin_pb2_grpc.AdminServicer):
    """Serves ``StartProfile`` / ``StopProfile`` for ``tracer``, forwarding to ``peers``.

    Args:
        tracer: this service's tracer.
        root: the folder windows go under (``--profile-dir``); ``None``: ``StartProfile`` is refused.
        peers: service name -> ``HOST:PORT`` of the peers to forward to (prepare: device and
            reclaim; empty elsewhere).
        tls: the TLS files the peers are dialled with (``None``: plaintext).
    """

    def __init__(self, tracer: Tracer, root: Path | None, peers: Mapping[str, str] | None = None, tls: TlsFiles | None = None) -> None:
        self._tracer = tracer
        self._root = root
        self._peers = dict(peers or {})
        self._tls = tls

    def StartProfile(self, request: admin_pb2.StartProfileRequest, context: grpc.ServicerContext) -> admin_pb2.ProfileReply:
        try:
            return self._start(request)
        except ProfileError as error:
            context.abort(error.code, error.message)

    def StopProfile(self, request: admin_pb2.StopProfileRequest, context: grpc.ServicerContext) -> admin_pb2.ProfileReply:
        try:
            return self._stop(request)
        except ProfileError as error:
            context.abort(error.code, error.message)

    def _start(self, request: admin_pb2.StartProfileRequest) -> admin_pb2.ProfileReply:
        service = self._tracer.service
        if request.trace_dir:
            raise ProfileError(grpc.StatusCode.INVALID_ARGUMENT,
                               "trace_dir is no longer accepted; give name, a folder name under each service's --profile-dir")
        if self._root is None:
            raise ProfileError(grpc.StatusCode.FAILED_PRECONDITION, f"{service}: no --profile-dir is configured")
        folder = profile_folder(self._root, request.name)
        try:
            self._tracer.start(folder)
        except RuntimeError as exc:
            raise ProfileError(grpc.StatusCode.FAILED_PRECONDITION, f"{service}: a trace window is already recording; call StopProfile first") from exc
        except OSError as exc:
            log.error("StartProfile: cannot create %s: %s", folder, exc)
            raise ProfileError(grpc.StatusCode.INTERNAL, f"{service}: cannot create the folder of name {request.name!r}; see its log") from exc
        log.info("profiling into %s (StartProfile)", folder)
        reply = admin_pb2.ProfileReply(services=[admin_pb2.ServiceProfile(service=service, trace_dir=str(folder))])
        if request.local_only:
            return reply
        started: list[tuple[str, str]] = []
        forwarded = admin_pb2.StartProfileRequest(name=request.name)
        try:
            for name, address in self._peers.items():
                answer = self._call_peer(name, address, "StartProfile",
                                         lambda stub: stub.StartProfile(forwarded, timeout=PEER_TIMEOUT_S))
                started.append((name, address))
                _add_peer_parts(reply, answer, address)
        except ProfileError:
            for name, address in started:  # leave nothing recording after a failed call
                try:
                    self._call_peer(name, address, "StopProfile", _stop_peer)
                except ProfileError as undo:
                    log.warning("could not stop the window just started on %s: %s", name, undo.message)
            self._tracer.stop()
            raise
        return reply

    def _stop(self, request: admin_pb2.StopProfileRequest) -> admin_pb2.ProfileReply:
        service = self._tracer.service
        failures: list[ProfileError] = []
        reply = admin_pb2.ProfileReply()
        try:
            written = self._tracer.stop()
            log.info("trace window written to %s (StopProfile)", written)
            reply.services.add(service=service, trace_file=str(written))
        except RuntimeError:  # the tracer's own message names its Python API, not this RPC
            failures.append(ProfileError(grpc.StatusCode.FAILED_PRECONDITION,
                                         f"{service}: no trace window is recording; start one with StartProfile"))
        except OSError as exc:
            log.error("StopProfile: cannot write the trace window: %s", exc)
            failures.append(ProfileError(grpc.StatusCode.INTERNAL, f"{service}: cannot write the trace window; see its log"))
        if not request.local_only:
            for name, address in self._peers.items():  # stop every peer even when one fails
                try:
                    answer = self._call_peer(name, address, "StopProfile", _stop_peer)
                    _add_peer_parts(reply, answer, address)
                except ProfileError as error:
                    failures.append(error)
        if failures:
            written = ", ".join(f"{part.service}: {part.trace_file}" for part in reply.services)
            raise ProfileError(failures[0].code, "; ".join(f.message for f in failures) + (f" (written: {written})" if written else ""))
        return reply

    def _call_peer(self, name: str, address: str, method: str,
                   call: Callable[[admin_pb2_grpc.AdminStub], admin_pb2.ProfileReply]) -> admin_pb2.ProfileReply:
        """``call`` on a stub of the peer at ``address``; its failure as a :class:`ProfileError` naming the peer."""
        with dial(address, self._tls) as channel:
            try:
                return call(admin_pb2_grpc.AdminStub(channel))
            except grpc.RpcError as exc:
                raise ProfileError(exc.code(), f"{name} at {address}: {method} failed: {exc.details()}") from exc


def _stop_peer(stub: admin_pb2_grpc.AdminStub) -> admin_pb2.ProfileReply:
    return stub.StopProfile(admin_pb2.StopProfileRequest(), timeout=PEER_TIMEOUT_S)


def _add_peer_parts(reply: admin_pb2.ProfileReply, answer: admin_pb2.ProfileReply, address: str) -> None:
    for part in answer.services:
        reply.services.add(service=part.service, address=part.address or address, trace_dir=part.trace_dir, trace_file=part.trace_file)
