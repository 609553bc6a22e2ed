"""The OpenAI-compatible HTTP API of prepare: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/responses`` (stateless, ``responses_api.py``), ``GET /v1/models``, and as vLLM serves
them ``POST /tokenize``, ``POST /detokenize`` and ``GET /metrics`` (prepare's Prometheus metrics, as
open as ``GET /health``), on FastAPI served by uvicorn on prepare's ``grpc.aio`` event loop
(``--http-port``).

Each request body is mapped onto the gRPC API's ``GenerateRequest`` (``openai_protocol.py``) and
goes through the same :class:`~stageserve.prepare.frontend.GenerationFrontend` as a gRPC call:
one validation, one scheduler, the same readiness and draining. Streaming (``stream: true``) is
server-sent events, ending with ``data: [DONE]``; ``stream_options.include_usage`` adds the usage
chunk (and vLLM's ``continuous_usage_stats`` usage in every chunk). Request fields follow the
tolerance policy (``openai_tolerance.py``); tool calls are read by ``tool_calls.py``, reasoning by
``reasoning.py``. A client that disconnects (streaming or not) aborts its request, which frees its
KV blocks.

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``; the status follows
the gRPC one: 400 ``INVALID_ARGUMENT`` (``param`` names the field), 404 an unknown model, 409
``ALREADY_EXISTS``, 429 ``RESOURCE_EXHAUSTED`` with ``Retry-After``, 503 ``UNAVAILABLE`` (draining,
or a pipeline service down), 504 ``DEADLINE_EXCEEDED``, 500 otherwise. An error after a stream has
started is sent as one ``data: {"error": ...}`` event before ``[DONE]`` (as vLLM does).

Security: with API keys (the same :class:`~stageserve.security.guard.AccessPolicy` as gRPC),
every route needs ``Authorization: Bearer KEY`` (``/health`` only with ``--no-open-health``):
401 without a key or with an unknown one (the OpenAI SDK's ``AuthenticationError``); the key's
request ids are its own, as on gRPC. A body over ``limits.MAX_REQUEST_BYTES`` is refused with 413
before it is parsed; a body nested deeper than `MAX_BODY_DEPTH`, or holding a lone surrogate
(``"\\ud800"``), is refused with 400. The connection-level bounds (header timeout, keep-alive,
concurrency, framing) are ``http_edge.py``'s. With ``--tls-cert``/``--tls-key`` uvicorn serves HTTPS.
"""

from __future__ import annotations

import array
import asyncio
import base64
import json
import re
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path

import grpc
import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from stageserve.prepare.errors import RequestError, invalid_argument
from stageserve.prepare.frontend import GenerationFrontend, Submission
from stageserve.prepare.http_edge import (KEEP_ALIVE_S, MAX_CONNECTIONS, MAX_HEADER_BYTES, HeaderDeadlineProtocol,
                                          refuse_ambiguous_framing)
from stageserve.prepare.limits import MAX_PROMPT_TOKEN_IDS, MAX_REQUEST_BYTES, at_most
from stageserve.prepare.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeBody, EmbeddingsBody, TokenizeBody, chat_request,
                                                completion_request)
from stageserve.prepare.openai_responses import ResponseBuilder, sse
from stageserve.prepare.reasoning import constrain_after_reasoning, reasoning_reader
from stageserve.prepare.responses_api import ResponseEvents, ResponsesRequest, chat_body, response_object, response_shell
from stageserve.prepare.tool_calls import tool_call_reader
from stageserve.prepare.validation import validate_request_id
from stageserve.security.guard import HEALTH_SERVICE, OPEN, PUBLIC, AccessPolicy
from stageserve.security.tls import TlsFiles
from stageserve.structured_output import MAX_JSON_DEPTH, too_deep
from stageserve.v1 import prepare_pb2

HTTP_PORT_SUFFIX = ".http-port"
MAX_BODY_DEPTH = MAX_JSON_DEPTH + 8
"""Nesting of a request body at most: a schema's own `MAX_JSON_DEPTH` and the fields around it
(``response_format.json_schema.schema``, ``tools[i].function.parameters``)."""
RETRY_AFTER_S = 1
TOO_LARGE = "REQUEST_TOO_LARGE"  # the RequestError reason of a body over MAX_REQUEST_BYTES: HTTP 413
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.ABORTED: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
# The field a validation message starts with: "max_tokens: ...", "stop[2]: ...", "messages.0.content: ...".
_PARAM = re.compile(r"^([a-z_]+)[\w.\[\]-]*:")


def http_port_file(port_file: Path) -> Path:
    """Where the bound HTTP port is written for a service whose ``--port-file`` is ``port_file``."""
    return port_file.with_suffix(HTTP_PORT_SUFFIX)


def error_response(error: RequestError) -> JSONResponse:
    """OpenAI's error body and HTTP status for ``error`` (``Retry-After`` on 429)."""
    status, kind = (413, "invalid_request_error") if error.reason == TOO_LARGE else _HTTP_STATUS.get(error.code, (500, "internal_error"))
    match = _PARAM.match(error.message) if error.code == grpc.StatusCode.INVALID_ARGUMENT else None
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return JSONResponse(status_code=status, headers=headers, content=_error_body(error, kind, match.group(1) if match else None))


def _error_body(error: RequestError, kind: str, param: str | None) -> dict:
    return {"error": {"message": error.message, "type": kind, "param": param, "code": error.code.name.lower()}}


def _parse(model: type[pydantic.BaseModel], body: object) -> pydantic.BaseModel:
    """``body`` as ``model``. Raises RequestError (``INVALID_ARGUMENT``) naming the first bad field."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise invalid_argument(f"{where}: {first['msg']}") from exc


def create_app(frontend: GenerationFrontend, policy: AccessPolicy | None = None, tool_call_parser: str = "hermes",
               reasoning_parser: str | None = None) -> FastAPI:
    """The FastAPI application over ``frontend`` (which must run on the same event loop); callers
    are checked against ``policy`` (default: open); ``tool_choice: auto`` reads calls with
    ``tool_call_parser`` (one of ``tool_calls.TOOL_CALL_PARSERS``); chat answers are split into
    reasoning and content by ``reasoning_parser`` (one of ``reasoning.REASONING_PARSERS``; ``None``: not split)."""
    app = FastAPI(title="stageserve OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    policy = policy or AccessPolicy()

    def after_reasoning(body: ChatCompletionRequest, grpc_request: prepare_pb2.GenerateRequest) -> prepare_pb2.GenerateRequest:
        """A chat request whose constraint, with a reasoning parser, applies after the reasoning only:
        ``response_format``'s and a forced tool call's; vLLM's ``structured_outputs`` is the client's
        own grammar over the whole text (reasoning included) and is left as it is."""
        if reasoning_parser is not None and grpc_request.HasField("constraint") and body.structured_outputs is None:
            grpc_request.constraint.CopyFrom(constrain_after_reasoning(grpc_request.constraint, reasoning_parser))
        return grpc_request

    def readers(body: ChatCompletionRequest, grpc_request: prepare_pb2.GenerateRequest) -> dict:
        """The ``_generate`` arguments that make a chat choice's tool-call and reasoning readers."""
        tools, mode = list(grpc_request.tools), body.tool_mode
        return {"new_reader": lambda: tool_call_reader(tools, mode, tool_call_parser),
                "new_thinker": lambda: reasoning_reader(reasoning_parser)}

    @app.exception_handler(RequestError)
    async def refused(_request: Request, error: RequestError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def unrouted(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """OpenAI's error body for a route or method not served (FastAPI's own is ``{"detail"}``)."""
        if error.status_code not in (404, 405):
            return JSONResponse({"error": {"message": str(error.detail), "type": "invalid_request_error", "param": None,
                                           "code": None}}, status_code=error.status_code)
        served = ", ".join(sorted(f"{method} {route.path}" for route in app.routes for method in getattr(route, "methods", ())))
        message = f"{request.method} {request.url.path}: not served here (served: {served})"
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "not_found"}},
                            status_code=error.status_code)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        _owner(policy, request, policy.access(HEALTH_SERVICE))
        model_name(frontend)  # raises UNAVAILABLE while draining or not connected
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _owner(policy, request)
        name = model_name(frontend)
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "stageserve"}]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        owner = _owner(policy, request)
        body = _parse(ChatCompletionRequest, await _json(request))
        grpc_request = after_reasoning(body, chat_request(body))
        return await _generate(frontend, request, body, grpc_request, owner, chat=True,
                               top_logprobs=(body.top_logprobs or 0) if body.logprobs else None, **readers(body, grpc_request))

    @app.post("/v1/completions")
    async def completions(request: Request):
        owner = _owner(policy, request)
        body = _parse(CompletionRequest, await _json(request))
        return await _generate(frontend, request, body, completion_request(body), owner, chat=False, top_logprobs=body.logprobs)

    @app.post("/v1/responses")
    async def responses(request: Request):
        owner = _owner(policy, request)
        body = _parse(ResponsesRequest, await _json(request))
        chat = _parse(ChatCompletionRequest, chat_body(body))
        grpc_request = after_reasoning(chat, chat_request(chat))
        request_id = _request_id(request)
        shell = response_shell(body, request_id, model_name(frontend))
        return await _generate(frontend, request, chat, grpc_request, owner, chat=True, top_logprobs=None, request_id=request_id,
                               **readers(chat, grpc_request), whole=lambda completion: response_object(completion, shell),
                               streamed=ResponseEvents(shell, stream_error_body).events)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        owner = _owner(policy, request)
        body = _parse(EmbeddingsBody, await _json(request))
        name, request_id = _check_model(frontend, body.model), _request_id(request)
        width = frontend.router.load()[0].attach.hidden_size
        if body.dimensions is not None and body.dimensions != width:
            raise invalid_argument(f"dimensions: {body.dimensions} is not supported; this model's embeddings have {width} (leave it unset)")
        reply = await frontend.embed(body.grpc(request_id), request_id, owner=owner)
        return JSONResponse({"object": "list", "model": name, "data": [
            {"object": "embedding", "index": i, "embedding": _encoded(vector.values, body.encoding_format)} for i, vector in enumerate(reply.data)],
            "usage": {"prompt_tokens": reply.prompt_tokens, "total_tokens": reply.prompt_tokens}})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        owner = _owner(policy, request)
        body = _parse(TokenizeBody, await _json(request))
        _check_model(frontend, body.model, optional=True)
        tokenize = prepare_pb2.TokenizeRequest(prompt=body.prompt, messages=[m.grpc() for m in body.messages])
        ids = await frontend.tokenize(tokenize, owner, body.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": frontend.router.model_limits().max_model_len, "tokens": ids,
                             "token_strs": frontend.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        _owner(policy, request)
        body = _parse(DetokenizeBody, await _json(request))
        _check_model(frontend, body.model, optional=True)
        at_most("tokens", len(body.tokens), MAX_PROMPT_TOKEN_IDS, "entries")
        vocab_size = frontend.router.model_limits().vocab_size
        for i, token_id in enumerate(body.tokens):
            if not 0 <= token_id < vocab_size:
                raise invalid_argument(f"tokens[{i}]: token id {token_id} is outside the vocabulary [0, {vocab_size})")
        text = await asyncio.get_running_loop().run_in_executor(None, frontend.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        _owner(policy, request, policy.access(HEALTH_SERVICE))  # as open as /health: scrapers send no key
        return Response(generate_latest(frontend.router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _owner(policy: AccessPolicy, request: Request, access: str = PUBLIC) -> str:
    """The name of the request's API key ("" without keys). Raises RequestError (401/403) when refused."""
    if access == OPEN:
        return ""
    denial, principal = policy.check(access, "the OpenAI API", request.headers.get("authorization", ""), peer_verified=False)
    if denial is not None:
        raise RequestError(denial.code, denial.message)
    return principal.name if principal is not None else ""


def model_name(frontend: GenerationFrontend) -> str:
    """The served model's name. Raises RequestError (``UNAVAILABLE``) while draining or not connected."""
    frontend.router.model_limits()  # the readiness check both APIs share
    return frontend.model_name(frontend.router.load()[0].attach)


def _check_model(frontend: GenerationFrontend, requested: str, optional: bool = False) -> str:
    """The served name if ``requested`` is one of its names (``optional``: or empty, as the utility
    routes allow). Raises RequestError: 404 naming the served one."""
    served = model_name(frontend)
    if not (optional and not requested) and requested not in (served, *frontend.served_names):
        raise RequestError(grpc.StatusCode.NOT_FOUND, f"model: {requested!r} is not served here; use {served!r} (see /v1/models)")
    return served


def _encoded(values, encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: floats, or base64 of its float32 little-endian bytes."""
    return list(values) if encoding_format == "float" else base64.b64encode(array.array("f", values).tobytes()).decode()


async def _json(request: Request) -> object:
    """The body as JSON, read up to `MAX_REQUEST_BYTES`. Raises RequestError: 413 when larger, 400 when not JSON."""
    too_large = RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"body: more than the maximum of {MAX_REQUEST_BYTES} bytes; send a shorter prompt", reason=TOO_LARGE)
    if int(request.headers.get("content-length") or 0) > MAX_REQUEST_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_REQUEST_BYTES:
            raise too_large
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise invalid_argument(f"body: not valid JSON ({exc})") from exc
    except RecursionError:  # nested past the parser's recursion: far past the limit
        raise invalid_argument(too_deep("body", MAX_BODY_DEPTH)) from None
    _check_parsed(value)
    return value


def _check_parsed(value: object) -> None:
    """Refuse a parsed body nested deeper than `MAX_BODY_DEPTH`, or holding a string that is not
    Unicode text: JSON's ``\\ud800`` escape alone parses to a lone surrogate, which no encoder (the
    tokenizer's, protobuf's) takes. Raises RequestError (``INVALID_ARGUMENT``)."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if not node.isascii():
                try:
                    node.encode()
                except UnicodeEncodeError as exc:
                    raise invalid_argument(f"body: a string holds the lone surrogate {node[exc.start]!a} (a \\uD800-\\uDFFF"
                                           " escape not in a high-low pair); send valid UTF-8 or paired escapes") from None
        elif isinstance(node, (dict, list)):
            if depth >= MAX_BODY_DEPTH:
                raise invalid_argument(too_deep("body", MAX_BODY_DEPTH))
            children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)


async def _generate(frontend: GenerationFrontend, request: Request, body, grpc_request: prepare_pb2.GenerateRequest, owner: str,
                    chat: bool, top_logprobs: int | None, new_reader: Callable = lambda: None, new_thinker: Callable = lambda: None,
                    request_id: str = "",
                    whole: Callable[[dict], dict] = lambda response: response,
                    streamed: Callable[[AsyncIterator[dict]], AsyncIterator[str]] | None = None):
    """Serve one completion request (``body``, mapped onto ``grpc_request``), streamed or whole; a
    disconnect aborts it. ``request_id``: the one to serve it under (default: :func:`_request_id`). ``whole`` reshapes the whole response, ``streamed`` turns the chunks into
    the SSE body (default: one event per chunk, then ``[DONE]``)."""
    served = _check_model(frontend, body.model)
    request_id = request_id or _request_id(request)
    submission = await frontend.submit(grpc_request, request_id, owner=owner)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, submission))
    builder = ResponseBuilder(chat, request_id, served, len(submission.handles), top_logprobs, submission.num_prompt_tokens,
                              frontend.tokenizer, new_reader, continuous_usage=body.include_usage and body.continuous_usage,
                              new_thinker=new_thinker)
    headers = {"x-request-id": request_id}
    if body.stream:
        chunks = _chunks(frontend, submission, builder, body.include_usage, watcher)
        return StreamingResponse((streamed or _sse)(chunks), media_type="text/event-stream", headers=headers)
    try:
        async with aclosing(submission.events(frontend.waker)) as events:
            async for index, event in events:
                builder.add(index, event)
    finally:
        _end(submission, watcher)
    return JSONResponse(whole(builder.response()), headers=headers)


def _request_id(request: Request) -> str:
    """The request's ``x-request-id`` (checked), else a new one. Raises RequestError (400) for a bad one."""
    return validate_request_id(request.headers.get("x-request-id") or uuid.uuid4().hex)


async def _chunks(frontend: GenerationFrontend, submission: Submission, builder: ResponseBuilder, include_usage: bool,
                  watcher: asyncio.Task) -> AsyncIterator[dict]:
    """The chunks: the opening ones, one per event, the usage chunk if asked. Raises RequestError: the request failed."""
    try:
        for chunk in builder.first_chunks():
            yield chunk
        async with aclosing(submission.events(frontend.waker)) as events:
            async for index, event in events:
                if (chunk := builder.chunk(index, event, include_usage)) is not None:
                    yield chunk
        if include_usage:
            yield builder.usage_chunk()
    finally:
        _end(submission, watcher)


def stream_error_body(error: RequestError) -> dict:
    """OpenAI's error body of a request that failed after its stream started."""
    _, kind = _HTTP_STATUS.get(error.code, (500, "internal_error"))
    return _error_body(error, kind, None)


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """The SSE body of chat and text completions: one event per chunk, an error event if it fails, ``[DONE]``."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield sse(chunk)
    except RequestError as error:
        yield sse(stream_error_body(error))
    yield sse("[DONE]")


def _end(submission: Submission, watcher: asyncio.Task) -> None:
    watcher.cancel()
    submission.cancel()  # aborts the choices still running (after a disconnect); else a no-op
    submission.client_gone()  # ignored by the observers of choices that ended


async def _cancel_on_disconnect(request: Request, submission: Submission) -> None:
    """Abort ``submission`` once the client disconnects (the body is read: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    submission.cancel()


class HttpServer:
    """uvicorn serving ``app`` on ``loop`` (prepare's gRPC event loop), on a socket bound at once.

    Args:
        app: the ASGI application.
        host, port: where to listen; ``port`` 0 = ephemeral (:attr:`port` is the bound one).
        loop: the running event loop to serve on (from another thread).
        port_file: the service's ``--port-file``; the HTTP port goes to its sibling
            (:func:`http_port_file`), written atomically.
        tls: serve HTTPS with its certificate and key (``None``: plain HTTP).

    Raises:
        RuntimeError: the address cannot be bound (the message names it and the flag).
    """

    def __init__(self, app, host: str, port: int, loop: asyncio.AbstractEventLoop, port_file: Path | None = None,
                 tls: TlsFiles | None = None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and an
        # accepted socket inherits the listener's; with proto 0, Nagle held each response's body
        # behind its headers until the client's delayed ACK: ~40 ms on every kept-alive request.
        self._socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise RuntimeError(f"--http-port: cannot listen on {host}:{port} ({exc}); choose a free port or 0") from exc
        self.port = self._socket.getsockname()[1]
        ssl = {"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)} if tls is not None else {}
        checked = refuse_ambiguous_framing(app, lambda message: error_response(invalid_argument(message)))
        self._server = uvicorn.Server(uvicorn.Config(
            checked, log_level="warning", lifespan="off", access_log=False, http=HeaderDeadlineProtocol, timeout_keep_alive=KEEP_ALIVE_S,
            limit_concurrency=MAX_CONNECTIONS, h11_max_incomplete_event_size=MAX_HEADER_BYTES, **ssl))
        self._done = asyncio.run_coroutine_threadsafe(self._server.serve(sockets=[self._socket]), loop)
        if port_file is not None:
            target = http_port_file(port_file)
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_text(str(self.port))
            tmp.replace(target)

    def stop(self, timeout_s: float) -> None:
        """Stop accepting, let open responses end for up to ``timeout_s``, then close them (any thread but the loop's)."""
        self._server.config.timeout_graceful_shutdown = timeout_s
        self._server.should_exit = True
        try:
            self._done.result(timeout=timeout_s + 5.0)
        except Exception:  # a loop already stopped, or a connection that would not close
            self._done.cancel()
