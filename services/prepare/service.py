"""The public ``stageserve.v1.Generation`` servicer, on ``grpc.aio``.

Each RPC handler is a coroutine on prepare's gRPC event loop
(:class:`~stageserve.server.AioServiceServer`): through the
:class:`~stageserve.prepare.frontend.GenerationFrontend` (shared with the OpenAI-compatible HTTP
API) it validates, hands the request's choices to the router (which places each on one device's
engine) and turns their events into responses, awaiting them without a thread per stream
(:meth:`~stageserve.prepare.request_handle.RequestHandle.events_async`). The request id comes from the
request field, else the ``x-request-id`` metadata, else is generated; it is echoed in every
response and in the ``x-request-id`` response header. When the client cancels, disconnects or
passes its deadline, ``grpc.aio`` cancels the handler's task; the RPC's done callback then aborts
the request in the scheduler, which frees its KV blocks. A request ends with exactly one terminal
message: its last chunk (finish reason, usage) or a gRPC status sent through ``context.abort``.
The handler feeds each event to the request's :class:`~stageserve.prepare.metrics.RequestObserver`
just before forwarding it (TTFT, ITL, e2e, ``request.*`` trace events); refused requests are
counted in ``stageserve_requests_total``. With API keys (``stageserve.security``: the guard
interceptor has checked the key before a handler runs), a request id is the caller's key's own:
``Abort`` and the duplicate check see only that key's requests.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from stageserve.prepare.choice_text import split_choice_text
from stageserve.prepare.early_aborts import caller_of
from stageserve.prepare.error_details import abort_rpc
from stageserve.prepare.errors import RequestError, invalid_argument
from stageserve.prepare.frontend import GenerationFrontend, Submission
from stageserve.prepare.reasoning import ReasoningReader, constrain_after_reasoning, reasoning_reader
from stageserve.prepare.router import DeviceFigures
from stageserve.prepare.tool_calls import TOOL_CALL_PARSERS, ToolCallReader
from stageserve.prepare.validation import validate_request_id
from stageserve.security.guard import current_principal
from stageserve.v1 import prepare_pb2, prepare_pb2_grpc, reclaim_pb2

SERVICE_NAME = "stageserve.v1.Generation"  # its readiness entry and reflection name
REQUEST_ID_HEADER = "x-request-id"
# A call that ends this close (seconds) to its deadline is counted as DEADLINE_EXCEEDED, not CANCELLED.
DEADLINE_SLACK_S = 0.25


def stream_chunk(request_id: str, event: reclaim_pb2.SequenceEvent, index: int = 0, cached_tokens: int = 0) -> prepare_pb2.GenerateStreamResponse | None:
    """The ``GenerateStreamResponse`` of one published event of choice ``index`` (finish fields and
    usage on the last, with ``cached_tokens`` prompt tokens served from the prefix cache); ``None``
    for an event with no text, token ids or finish: the client is sent nothing for it."""
    if not (event.text or event.token_ids or event.finish_reason):
        return None
    chunk = prepare_pb2.GenerateStreamResponse(
        request_id=request_id, text=event.text, token_ids=event.token_ids, logprobs=event.logprobs, finish_reason=event.finish_reason,
        index=index,
    )
    if event.finish_reason:
        chunk.stop_string = event.stop_string
        if event.HasField("stop_token_id"):
            chunk.stop_token_id = event.stop_token_id
        chunk.usage.prompt_tokens = event.prompt_tokens
        chunk.usage.completion_tokens = event.completion_tokens
        chunk.usage.cached_tokens = cached_tokens
        chunk.usage.draft_tokens, chunk.usage.accepted_tokens = event.draft_tokens, event.accepted_tokens
    return chunk


async def _announced_request_id(field: str, context: grpc.aio.ServicerContext) -> str:
    """The call's request id (the field, else the ``x-request-id`` metadata, else a new one), checked
    and sent back in the response headers. Raises RequestError (INVALID_ARGUMENT) for a bad one."""
    request_id = field or dict(context.invocation_metadata()).get(REQUEST_ID_HEADER, "") or uuid.uuid4().hex
    await context.send_initial_metadata(((REQUEST_ID_HEADER, validate_request_id(request_id)),))
    return request_id


def _split_answer(chunk: prepare_pb2.GenerateStreamResponse, thinker: ReasoningReader | None, reader: ToolCallReader | None) -> None:
    """Move ``chunk``'s reasoning to ``reasoning_text`` and its completed tool calls to ``tool_calls``
    (`split_choice_text`; the last chunk flushes what was held back); nothing without readers."""
    if thinker is None and reader is None:
        return
    reasoning, answer, calls = split_choice_text(thinker, reader, chunk.text, bool(chunk.finish_reason))
    chunk.text, chunk.reasoning_text = answer, reasoning
    chunk.tool_calls.extend(prepare_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"]) for c in calls)


def device_status(device: DeviceFigures) -> prepare_pb2.DeviceStatus:
    """One device's ``DeviceStatus`` (load figures 0 while detached)."""
    status = prepare_pb2.DeviceStatus(address=device.address, instance_id=device.instance_id, attached=device.attached,
                                      accepting=device.accepting, stalled=device.stalled)
    if device.load is not None:
        status.kv_blocks_total, status.kv_blocks_free = device.load.kv_blocks_total, device.load.kv_blocks_free
        status.running_requests, status.waiting_requests = device.load.running, device.load.waiting
        status.kv_blocks_cached = device.load.kv_blocks_cached
    return status


def _owner() -> str:
    """The name of the running RPC's API key; "" when the service has no keys."""
    principal = current_principal()
    return principal.name if principal is not None else ""


class GenerationServicer(prepare_pb2_grpc.GenerationServicer):
    """Serves the public API through ``frontend`` (validation, submission, events; its waker is the
    ``grpc.aio`` server's loop's). ``Tokenize`` runs in the loop's default executor, so that a long
    prompt (milliseconds of chat template and tokenizer) does not hold up every other stream's chunks."""

    def __init__(self, frontend: GenerationFrontend, reasoning_parser: str | None = None, tool_call_parser: str = "hermes") -> None:
        self._frontend = frontend
        self._router = frontend.router
        self._tokenizer = frontend.tokenizer
        self._reasoning_parser = reasoning_parser  # ``separate_reasoning``'s (``reasoning.REASONING_PARSERS``); None: refused
        self._tool_call_parser = tool_call_parser  # ``parse_tool_calls``' (``tool_calls.TOOL_CALL_PARSERS``)

    async def GenerateStream(self, request: prepare_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Stream the completion: one chunk per published step with new text or ids; the last has
        finish_reason and usage. Errors (gRPC status): INVALID_ARGUMENT, ALREADY_EXISTS,
        RESOURCE_EXHAUSTED at admission; UNAVAILABLE, INTERNAL, CANCELLED, DEADLINE_EXCEEDED later."""
        submission = await self._accept(request, context)
        thinkers, callers = self._thinkers(request, submission), self._tool_readers(request, submission)
        async with aclosing(self._events(submission, context)) as events:  # its finally runs now, not at GC
            async for index, event in events:
                if (chunk := stream_chunk(submission.request_id, event, index, submission.handles[index].cached_tokens)) is not None:
                    _split_answer(chunk, thinkers and thinkers[index], callers and callers[index])
                    await context.write(chunk)

    async def Generate(self, request: prepare_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> prepare_pb2.GenerateResponse:
        """The whole completion at once: the stream's chunks joined per choice (choice 0 in the
        top-level fields, all in ``choices`` when n > 1); same errors as GenerateStream."""
        submission = await self._accept(request, context)
        thinkers, callers = self._thinkers(request, submission), self._tool_readers(request, submission)
        choices = [prepare_pb2.GenerateStreamResponse(request_id=submission.request_id, index=i) for i in range(len(submission.handles))]
        texts: list[list[str]] = [[] for _ in choices]
        reasonings: list[list[str]] = [[] for _ in choices]
        async with aclosing(self._events(submission, context)) as events:
            async for index, event in events:
                if (chunk := stream_chunk(submission.request_id, event, index, submission.handles[index].cached_tokens)) is not None:
                    _split_answer(chunk, thinkers and thinkers[index], callers and callers[index])
                    texts[index].append(chunk.text)
                    reasonings[index].append(chunk.reasoning_text)
                    choices[index].MergeFrom(chunk)  # appends the ids and logprobs; the last chunk sets the finish fields
        for choice, text, reasoning in zip(choices, texts, reasonings):
            choice.text, choice.reasoning_text = "".join(text), "".join(reasoning)
        first = choices[0]
        response = prepare_pb2.GenerateResponse(
            request_id=submission.request_id, text=first.text, token_ids=first.token_ids, logprobs=first.logprobs,
            finish_reason=first.finish_reason, stop_string=first.stop_string, choices=choices if len(choices) > 1 else [],
            reasoning_text=first.reasoning_text, tool_calls=first.tool_calls,
        )
        if first.HasField("stop_token_id"):
            response.stop_token_id = first.stop_token_id
        response.usage.prompt_tokens = submission.num_prompt_tokens
        response.usage.completion_tokens = sum(choice.usage.completion_tokens for choice in choices)
        response.usage.cached_tokens = first.usage.cached_tokens
        response.usage.draft_tokens = sum(choice.usage.draft_tokens for choice in choices)
        response.usage.accepted_tokens = sum(choice.usage.accepted_tokens for choice in choices)
        return response

    async def Abort(self, request: prepare_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> prepare_pb2.AbortResponse:
        """Abort a running request by id; idempotent (unknown or finished ids give aborted=false). An
        unknown id's abort is kept for a request of this caller that registers within 10 s (``early_aborts.py``)."""
        return prepare_pb2.AbortResponse(aborted=self._frontend.abort(request.request_id, caller_of(context), _owner()))

    async def Tokenize(self, request: prepare_pb2.TokenizeRequest, context: grpc.aio.ServicerContext) -> prepare_pb2.TokenizeResponse:
        """Token ids and strings of a prompt or chat, exactly as Generate would see them; INVALID_ARGUMENT for a bad input."""
        try:
            ids = await self._frontend.tokenize(request, _owner())
            return prepare_pb2.TokenizeResponse(token_ids=ids, tokens=self._tokenizer.convert_ids_to_tokens(ids), count=len(ids))
        except RequestError as error:
            await abort_rpc(context, error)

    async def Embed(self, request: prepare_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> prepare_pb2.EmbedResponse:
        """One L2-normalised vector per input (``embeddings.py``). Errors (gRPC status): INVALID_ARGUMENT,
        FAILED_PRECONDITION (the device does not embed), ALREADY_EXISTS, RESOURCE_EXHAUSTED,
        UNAVAILABLE at admission; UNAVAILABLE, INTERNAL, ABORTED later."""
        try:
            request_id = await _announced_request_id(request.request_id, context)
            return await self._frontend.embed(request, request_id, caller_of(context), _owner())
        except RequestError as error:
            await abort_rpc(context, error)

    async def GetModelInfo(self, request: prepare_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> prepare_pb2.ModelInfo:
        """Model facts and load, summed over attached devices plus per device. While none is attached,
        only the devices (``attached: false``), so a client can see which one is down."""
        try:
            load, devices = self._router.load()
        except RequestError:
            return prepare_pb2.ModelInfo(devices=[device_status(device) for device in self._router.devices()])
        attach = load.attach
        return prepare_pb2.ModelInfo(
            model_name=self._frontend.model_name(attach),
            vocab_size=attach.vocab_size,
            max_model_len=attach.max_model_len,
            eos_token_ids=attach.eos_token_ids,
            backend=attach.backend,
            dtype=attach.dtype,
            dispatch=attach.dispatch,
            pipeline_depth=attach.pipeline_depth,
            kv_block_size=attach.kv_block_size,
            kv_blocks_total=load.kv_blocks_total,
            kv_blocks_free=load.kv_blocks_free,
            running_requests=load.running,
            waiting_requests=load.waiting,
            max_num_seqs=attach.max_num_seqs,
            devices=[device_status(device) for device in devices],
            pooling=attach.pooling,
            hidden_size=attach.hidden_size,
        )

    async def _accept(self, request: prepare_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> Submission:
        """Resolve the id, validate, submit; abort the RPC with the error's status if any step refuses."""
        try:
            request_id = await _announced_request_id(request.request_id, context)
            if request.separate_reasoning:
                self._reason_first(request)
            submission = await self._frontend.submit(request, request_id, caller_of(context), _owner())
        except RequestError as error:
            await abort_rpc(context, error)
        # Runs once the handler's task is done, however it ended (a finished request is no longer
        # the engine's, and the call only wakes a handler that no longer waits).
        context.add_done_callback(lambda _: submission.cancel())
        return submission

    def _reason_first(self, request: prepare_pb2.GenerateRequest) -> None:
        """``separate_reasoning``: put the reasoning before ``request``'s constraint. Raises RequestError
        (INVALID_ARGUMENT) when this server has no reasoning parser, or the combined grammar is too long."""
        if self._reasoning_parser is None:
            raise invalid_argument("separate_reasoning: this server has no --reasoning-parser; leave it false, or start prepare with"
                                   " --reasoning-parser deepseek_r1 or qwen3")
        if request.HasField("constraint"):
            request.constraint.CopyFrom(constrain_after_reasoning(request.constraint, self._reasoning_parser))

    def _thinkers(self, request: prepare_pb2.GenerateRequest, submission: Submission) -> list[ReasoningReader] | None:
        """One reasoning reader per choice when the request separates its reasoning, else ``None``."""
        if not request.separate_reasoning:
            return None
        return [reasoning_reader(self._reasoning_parser) for _ in submission.handles]

    def _tool_readers(self, request: prepare_pb2.GenerateRequest, submission: Submission) -> list[ToolCallReader] | None:
        """One tool-call reader per choice when the request asks its calls parsed (and has tools), else ``None``."""
        if not (request.parse_tool_calls and request.tools):
            return None
        return [TOOL_CALL_PARSERS[self._tool_call_parser]() for _ in submission.handles]

    async def _events(self, submission: Submission, context: grpc.aio.ServicerContext) -> AsyncIterator[tuple[int, reclaim_pb2.SequenceEvent]]:
        """The choices' ``(index, event)``s, each fed to its observer first; a terminal error aborts
        the RPC with its status; a handler that ends without a terminal tells the observer the client left."""
        try:
            async with aclosing(submission.events(self._frontend.waker)) as events:
                async for item in events:
                    yield item
        except RequestError as error:
            await abort_rpc(context, error)
        finally:
            # Ignored after a terminal; else the client left first (the task was cancelled). A
            # client whose deadline passes cancels the call a little before the server's copy of
            # the deadline (the server's starts when the request arrives), hence the slack.
            remaining = context.time_remaining()
            submission.client_gone(deadline_passed=remaining is not None and remaining < DEADLINE_SLACK_S)
