"""The ``stageserve.v1.Admin`` servicer: start and stop a trace window on a running service.

Every service serves it over its own :class:`~stageserve.tracing.Tracer`. A service created with
``peers`` (prepare: its device and reclaim) forwards each call to them after acting locally, so
one ``StartProfile`` to prepare profiles the whole deployment::

    grpcurl -plaintext -d '{"trace_dir": "/tmp/prof"}' localhost:50051 stageserve.v1.Admin/StartProfile
    grpcurl -plaintext localhost:50051 stageserve.v1.Admin/StopProfile

Errors are gRPC statuses naming the service and what to do: ``INVALID_ARGUMENT`` (empty
``trace_dir``), ``FAILED_PRECONDITION`` (already recording / not recording), ``INTERNAL`` (the
folder or file cannot be written), a peer's own status (prefixed with its name and address) or
``UNAVAILABLE`` when a peer does not answer. A ``StartProfile`` that fails at a peer stops the
windows it already started, so a failed call leaves nothing recording.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import grpc

from stageserve.tracing import Tracer
from stageserve.v1 import admin_pb2, admin_pb2_grpc

log = logging.getLogger(__name__)

ADMIN_SERVICE_NAME = "stageserve.v1.Admin"
PEER_TIMEOUT_S = 10.0  # a StopProfile writes the window's file, which can take seconds for a long window


class ProfileError(Exception):
    """A profile call failed; ``code`` and ``message`` become the RPC's status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class ProfileServicer(admin_pb2_grpc.AdminServicer):
    """Serves ``StartProfile`` / ``StopProfile`` for ``tracer``, forwarding to ``peers``.

    Args:
        tracer: this service's tracer.
        peers: service name -> ``HOST:PORT`` of the peers to forward to (prepare: device and
            reclaim; empty elsewhere).
    """

    def __init__(self, tracer: Tracer, peers: Mapping[str, str] | None = None) -> None:
        self._tracer = tracer
        self._peers = dict(peers or {})

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
        if not request.trace_dir:
            raise ProfileError(grpc.StatusCode.INVALID_ARGUMENT, "trace_dir is empty; give the folder the trace windows go to")
        service = self._tracer.service
        try:
            self._tracer.start(request.trace_dir)
        except RuntimeError as exc:
            raise ProfileError(grpc.StatusCode.FAILED_PRECONDITION, f"{service}: {exc}; call StopProfile first") from exc
        except OSError as exc:
            raise ProfileError(grpc.StatusCode.INTERNAL, f"{service}: cannot create trace_dir {request.trace_dir!r}: {exc}") from exc
        log.info("profiling into %s (StartProfile)", request.trace_dir)
        reply = admin_pb2.ProfileReply(services=[admin_pb2.ServiceProfile(service=service, trace_dir=request.trace_dir)])
        if request.local_only:
            return reply
        started: list[tuple[str, str]] = []
        try:
            for name, address in self._peers.items():
                answer = _call_peer(name, address, "StartProfile",
                                    lambda stub: stub.StartProfile(admin_pb2.StartProfileRequest(trace_dir=request.trace_dir), timeout=PEER_TIMEOUT_S))
                started.append((name, address))
                _add_peer_parts(reply, answer, address)
        except ProfileError:
            for name, address in started:  # leave nothing recording after a failed call
                try:
                    _call_peer(name, address, "StopProfile", _stop_peer)
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
            failures.append(ProfileError(grpc.StatusCode.INTERNAL, f"{service}: cannot write the trace window: {exc}"))
        if not request.local_only:
            for name, address in self._peers.items():  # stop every peer even when one fails
                try:
                    answer = _call_peer(name, address, "StopProfile", _stop_peer)
                    _add_peer_parts(reply, answer, address)
                except ProfileError as error:
                    failures.append(error)
        if failures:
            written = ", ".join(f"{part.service}: {part.trace_file}" for part in reply.services)
            raise ProfileError(failures[0].code, "; ".join(f.message for f in failures) + (f" (written: {written})" if written else ""))
        return reply


def _stop_peer(stub: admin_pb2_grpc.AdminStub) -> admin_pb2.ProfileReply:
    return stub.StopProfile(admin_pb2.StopProfileRequest(), timeout=PEER_TIMEOUT_S)


def _call_peer(name: str, address: str, method: str,
               call: Callable[[admin_pb2_grpc.AdminStub], admin_pb2.ProfileReply]) -> admin_pb2.ProfileReply:
    """``call`` on a stub of the peer at ``address``; its failure as a :class:`ProfileError` naming the peer."""
    with grpc.insecure_channel(address) as channel:
        try:
            return call(admin_pb2_grpc.AdminStub(channel))
        except grpc.RpcError as exc:
            raise ProfileError(exc.code(), f"{name} at {address}: {method} failed: {exc.details()}") from exc


def _add_peer_parts(reply: admin_pb2.ProfileReply, answer: admin_pb2.ProfileReply, address: str) -> None:
    for part in answer.services:
        reply.services.add(service=part.service, address=part.address or address, trace_dir=part.trace_dir, trace_file=part.trace_file)
