"""The server interceptors of every service: malformed requests and access control, per RPC.

:class:`Guard` wraps each method handler (once per method, cached) so that:

1. a request that does not decode as its protobuf type ends the RPC with ``INVALID_ARGUMENT``
   (grpc's own answer would be ``UNKNOWN`` or ``INTERNAL``): the deserializer hands a marker
   instead of raising, and the wrapped behaviour aborts on it, for unary and streamed requests;
2. the caller is checked against the method's access class (:data:`ACCESS`, by service name):

   ========  ==========================================================================
   open      health and reflection (unless ``--no-open-health`` / ``--no-open-reflection``:
             then as public)
   public    ``stageserve.v1.Generation``: an API key (``authorization: Bearer KEY``) when
             the service has keys; ``UNAUTHENTICATED`` without one or with an unknown one
   admin     ``stageserve.v1.Admin``: a peer with a verified client certificate (device and
             reclaim ask for one; prepare asks public callers for none, so there it is an admin
             key alone), or, when the service has keys, an admin key (``PERMISSION_DENIED``
             for another key)
   internal  ``stageserve.v1.Device`` / ``Reclaim``: with TLS, a verified client certificate
             (the server requires one from the trusted CA, so the handshake already refuses
             others; ``PERMISSION_DENIED`` stands behind it). Without TLS: open, for local
             development only (``docs/deploy.md``)
   ========  ==========================================================================

On ``grpc.aio`` the accepted key's :class:`~stageserve.security.keys.Principal` is available to the
handler as :func:`current_principal` (a context variable of the RPC's own task).
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from stageserve.security.keys import KeyRing, Principal, bearer_key

OPEN, PUBLIC, ADMIN, INTERNAL = "open", "public", "admin", "internal"
HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICES = ("grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")
ACCESS = {
    HEALTH_SERVICE: OPEN,
    **{name: OPEN for name in REFLECTION_SERVICES},
    "stageserve.v1.Generation": PUBLIC,
    "stageserve.v1.Admin": ADMIN,
    "stageserve.v1.Device": INTERNAL,
    "stageserve.v1.Reclaim": INTERNAL,
}
"""Access class of each service's methods; a service not listed is public."""

NO_KEY = "no API key: send the metadata 'authorization: Bearer <key>' (HTTP: the Authorization header)"
BAD_KEY = "the API key is not valid; use a key of the server's --api-keys-file"

_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("stageserve_principal", default=None)


def current_principal() -> Principal | None:
    """The principal of the running ``grpc.aio`` RPC's key; ``None`` when the service has no keys."""
    return _principal.get()


@dataclass(frozen=True)
class Denial:
    """Why a call is refused: its status code and a message saying what to send instead."""

    code: grpc.StatusCode
    message: str


@dataclass(frozen=True)
class AccessPolicy:
    """What a service requires of its callers.

    Attributes:
        keys: accepted API keys (empty: the public API is open).
        peer_certificates: the server verifies client certificates (mutual TLS): internal RPCs need one.
        open_health, open_reflection: whether health / reflection need nothing.
    """

    keys: KeyRing = field(default_factory=lambda: KeyRing([]))
    peer_certificates: bool = False
    open_health: bool = True
    open_reflection: bool = True

    def access(self, service: str) -> str:
        """The access class of ``service`` under this policy."""
        access = ACCESS.get(service, PUBLIC)
        if access == OPEN and not (self.open_health if service == HEALTH_SERVICE else self.open_reflection):
            return PUBLIC
        return access

    def check(self, access: str, service: str, authorization: str, peer_verified: bool) -> tuple[Denial | None, Principal | None]:
        """Decide one call: ``(denial or None, the key's principal or None)``.

        Args:
            access: the method's class (:meth:`access`).
            service: its service, for messages.
            authorization: the ``authorization`` metadata ("" when absent).
            peer_verified: the caller presented a client certificate the server verified.
        """
        if access == OPEN:
            return None, None
        if access == INTERNAL:
            if self.peer_certificates and not peer_verified:
                return Denial(grpc.StatusCode.PERMISSION_DENIED,
                              f"{service} is internal: only peers with a client certificate of the trusted CA may call it"), None
            return None, None
        if access == ADMIN and peer_verified:
            return None, None
        if not self.keys:
            return None, None
        key = bearer_key(authorization) if authorization else None
        if key is None:
            return Denial(grpc.StatusCode.UNAUTHENTICATED, NO_KEY), None
        principal = self.keys.lookup(key)
        if principal is None:
            return Denial(grpc.StatusCode.UNAUTHENTICATED, BAD_KEY), None
        if access == ADMIN and not principal.admin:
            return Denial(grpc.StatusCode.PERMISSION_DENIED,
                          f"key {principal.name!r} may not call {service}: it needs a key of the --admin-keys-file"), None
        return None, principal


class _Undecodable:
    """Stands for a request whose bytes did not decode (what the wrapped deserializer returns)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _safe_deserializer(deserialize: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    if deserialize is None:
        return None

    def decode(data: bytes) -> object:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
            return _Undecodable(f"{type(exc).__name__}: {exc}")

    return decode


def _undecodable_message(request: _Undecodable) -> str:
    return f"the request message does not decode as its protobuf type ({request.reason}); send a valid message"


class Guard:
    """Wraps method handlers as the module docstring says; one per server.

    Args:
        policy: the service's access policy.
    """

    def __init__(self, policy: AccessPolicy) -> None:
        self._policy = policy
        self._wrapped: dict[object, grpc.RpcMethodHandler] = {}

    def wrap(self, handler: grpc.RpcMethodHandler | None, method: str) -> grpc.RpcMethodHandler | None:
        """``handler`` of ``method`` (``/package.Service/Method``) wrapped; ``None`` stays ``None``."""
        if handler is None:
            return None
        wrapped = self._wrapped.get(handler)
        if wrapped is None:
            service = method.lstrip("/").split("/", 1)[0]
            wrapped = _wrap_handler(handler, self._policy, self._policy.access(service), service)
            self._wrapped[handler] = wrapped
        return wrapped


class SyncGuardInterceptor(grpc.ServerInterceptor):
    """:class:`Guard` as a ``grpc`` (thread-per-RPC) server interceptor."""

    def __init__(self, policy: AccessPolicy) -> None:
        self._guard = Guard(policy)

    def intercept_service(self, continuation, handler_call_details):
        return self._guard.wrap(continuation(handler_call_details), handler_call_details.method)


class AioGuardInterceptor(grpc.aio.ServerInterceptor):
    """:class:`Guard` as a ``grpc.aio`` server interceptor."""

    def __init__(self, policy: AccessPolicy) -> None:
        self._guard = Guard(policy)

    async def intercept_service(self, continuation, handler_call_details):
        return self._guard.wrap(await continuation(handler_call_details), handler_call_details.method)


def _wrap_handler(handler: grpc.RpcMethodHandler, policy: AccessPolicy, access: str, service: str) -> grpc.RpcMethodHandler:
    """A copy of ``handler`` with the safe deserializer and the checking behaviour."""
    kind = ("stream" if handler.request_streaming else "unary") + "_" + ("stream" if handler.response_streaming else "unary")
    inner = getattr(handler, kind)

    def decide(context) -> tuple[Denial | None, Principal | None]:
        authorization = next((value for key, value in context.invocation_metadata() or () if key == "authorization"), "")
        return policy.check(access, service, authorization, context.peer_identities() is not None)

    if inspect.iscoroutinefunction(inner) or inspect.isasyncgenfunction(inner):
        behavior = _aio_behavior(inner, decide, handler.request_streaming, inspect.isasyncgenfunction(inner))
    else:
        behavior = _sync_behavior(inner, decide, handler.request_streaming, handler.response_streaming)
    return handler._replace(request_deserializer=_safe_deserializer(handler.request_deserializer), **{kind: behavior})


def _sync_behavior(inner, decide, request_streaming: bool, response_streaming: bool):
    """A thread-run behaviour (``grpc`` server, or a plain function on ``grpc.aio``) that checks first."""

    def admit(request, context):
        denial, _ = decide(context)
        if denial is not None:
            context.abort(denial.code, denial.message)
        if request_streaming:
            return _sync_requests(request, context)
        if isinstance(request, _Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable_message(request))
        return request

    if response_streaming:
        def streaming(request, context):
            yield from inner(admit(request, context), context)
        return streaming

    def unary(request, context):
        return inner(admit(request, context), context)
    return unary


def _sync_requests(requests, context):
    for request in requests:
        if isinstance(request, _Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable_message(request))
        yield request


def _aio_behavior(inner, decide, request_streaming: bool, async_generator: bool):
    """A ``grpc.aio`` behaviour (coroutine or async generator) that checks first and sets :func:`current_principal`."""

    async def admit(request, context):
        denial, principal = decide(context)
        if denial is not None:
            await context.abort(denial.code, denial.message)
        _principal.set(principal)  # this RPC's task has a context of its own
        if request_streaming:
            return _aio_requests(request, context)
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable_message(request))
        return request

    if async_generator:
        async def streaming(request, context):
            async for response in inner(await admit(request, context), context):
                yield response
        return streaming

    async def coroutine(request, context):
        return await inner(await admit(request, context), context)
    return coroutine


async def _aio_requests(requests, context):
    async for request in requests:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable_message(request))
        yield request
