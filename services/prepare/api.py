"""The public ``stageserve.v1.Generation`` servicer, on ``grpc.aio``.

Each RPC handler is a coroutine on prepare's gRPC event loop
(:class:`~stageserve.server.AioServiceServer`): it validates, hands the request to the
:class:`~stageserve.prepare.router.DeviceRouter` (which places it on one device's engine) and
turns the request's events into responses, awaiting them without a thread per stream
(:meth:`~stageserve.prepare.request_handle.RequestHandle.events_async`). The request id comes from the
request field, else the ``x-request-id`` metadata, else is generated; it is echoed in every
response and in the ``x-request-id`` response header. When the client cancels, disconnects or
passes its deadline, ``grpc.aio`` cancels the handler's task; the RPC's done callback then aborts
the request in the scheduler, which frees its KV blocks. A request ends with exactly one terminal
message: its last chunk (finish reason, usage) or a gRPC status sent through ``context.abort``.
The handler feeds each event to the request's :class:`~stageserve.prepare.metrics.RequestObserver`
just before forwarding it (TTFT, ITL, e2e, ``request.*`` trace events); refused requests are
counted in ``stageserve_requests_total``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from stageserve.logs import REQUEST_ID
from stageserve.prepare.early_aborts import caller_of
from stageserve.prepare.error_details import abort_rpc
from stageserve.prepare.errors import RequestError
from stageserve.prepare.request_handle import LoopWaker, RequestHandle
from stageserve.prepare.router import DeviceFigures, DeviceRouter
from stageserve.prepare.validation import GenerationRequest, tokenize_prompt, validate_generate_request, validate_request_id
from stageserve.v1 import prepare_pb2, prepare_pb2_grpc, reclaim_pb2

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
# A call that ends this close (seconds) to its deadline is counted as DEADLINE_EXCEEDED, not CANCELLED.
DEADLINE_SLACK_S = 0.25


def stream_chunk(request_id: str, event: reclaim_pb2.SequenceEvent, cached_tokens: int = 0) -> prepare_pb2.GenerateStreamResponse | None:
    """The ``GenerateStreamResponse`` of one published event (finish fields and usage on the last,
    with ``cached_tokens`` prompt tokens served from the prefix cache);
    ``None`` for an event with no text, token ids or finish: the client is sent nothing for it."""
    if not (event.text or event.token_ids or event.finish_reason):
        return None
    chunk = prepare_pb2.GenerateStreamResponse(
        request_id=request_id, text=event.text, token_ids=event.token_ids, logprobs=event.logprobs, finish_reason=event.finish_reason,
    )
    if event.finish_reason:
        chunk.stop_string = event.stop_string
        if event.HasField("stop_token_id"):
            chunk.stop_token_id = event.stop_token_id
        chunk.usage.prompt_tokens = event.prompt_tokens
        chunk.usage.completion_tokens = event.completion_tokens
        chunk.usage.cached_tokens = cached_tokens
    return chunk


def device_status(device: DeviceFigures) -> prepare_pb2.DeviceStatus:
    """One device's ``DeviceStatus`` (load figures 0 while detached)."""
    status = prepare_pb2.DeviceStatus(address=device.address, instance_id=device.instance_id, attached=device.attached,
                                      accepting=device.accepting, stalled=device.stalled)
    if device.load is not None:
        status.kv_blocks_total, status.kv_blocks_free = device.load.kv_blocks_total, device.load.kv_blocks_free
        status.running_requests, status.waiting_requests = device.load.running, device.load.waiting
        status.kv_blocks_cached = device.load.kv_blocks_cached
    return status


class GenerationServicer(prepare_pb2_grpc.GenerationServicer):
    """Serves the public API on top of ``router``, on a ``grpc.aio`` server; ``tokenizer`` is the
    served model's tokenizer, ``waker`` that server's loop's (it hands each request's events to
    its handler). Tokenization runs in the loop's default executor, so that a long
    prompt (milliseconds of chat template and tokenizer) does not hold up every other stream's chunks."""

    def __init__(self, router: DeviceRouter, tokenizer, waker: LoopWaker) -> None:
        self._router = router
        self._tokenizer = tokenizer
        self._waker = waker

    async def GenerateStream(self, request: prepare_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Stream the completion: one chunk per published step with new text or ids; the last has
        finish_reason and usage. Errors (gRPC status): INVALID_ARGUMENT, ALREADY_EXISTS,
        RESOURCE_EXHAUSTED at admission; UNAVAILABLE, INTERNAL, CANCELLED, DEADLINE_EXCEEDED later."""
        handle = await self._accept(request, context)
        request_id = handle.request.request_id
        async with aclosing(self._events(handle, context)) as events:  # its finally runs now, not at GC
            async for event in events:
                if (chunk := stream_chunk(request_id, event, handle.cached_tokens)) is not None:
                    await context.write(chunk)

    async def Generate(self, request: prepare_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> prepare_pb2.GenerateResponse:
        """The whole completion at once: the stream's chunks joined; same errors as GenerateStream."""
        handle = await self._accept(request, context)
        response = prepare_pb2.GenerateResponse(request_id=handle.request.request_id)
        text = []
        async with aclosing(self._events(handle, context)) as events:
            async for event in events:
                text.append(event.text)
                response.token_ids.extend(event.token_ids)
                response.logprobs.extend(event.logprobs)
                if event.finish_reason:
                    final = stream_chunk(handle.request.request_id, event, handle.cached_tokens)
                    response.finish_reason, response.stop_string = final.finish_reason, final.stop_string
                    if final.HasField("stop_token_id"):
                        response.stop_token_id = final.stop_token_id
                    response.usage.CopyFrom(final.usage)
        response.text = "".join(text)
        return response

    async def Abort(self, request: prepare_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> prepare_pb2.AbortResponse:
        """Abort a running request by id; idempotent (unknown or finished ids give aborted=false). An
        unknown id's abort is kept for a request of this caller that registers within 10 s (``early_aborts.py``)."""
        return prepare_pb2.AbortResponse(aborted=self._router.abort(request.request_id, caller_of(context)))

    async def Tokenize(self, request: prepare_pb2.TokenizeRequest, context: grpc.aio.ServicerContext) -> prepare_pb2.TokenizeResponse:
        """Token ids and strings of a prompt or chat, exactly as Generate would see them; INVALID_ARGUMENT for a bad input."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, self._tokenize, request)
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
            model_name=attach.model_name,
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
        )

    async def _accept(self, request: prepare_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> RequestHandle:
        """Resolve the id, validate, submit; abort the RPC with the error's status if any step refuses."""
        header_id = dict(context.invocation_metadata()).get(REQUEST_ID_HEADER, "")
        request_id = request.request_id or header_id or uuid.uuid4().hex
        try:
            await context.send_initial_metadata(((REQUEST_ID_HEADER, validate_request_id(request_id)),))
            validated = await asyncio.get_running_loop().run_in_executor(None, self._validate, request, request_id)
            # On the loop, with no await until the done callback is set: a handler cancelled
            # in between would leave the request running for no one.
            handle = self._router.submit(validated, caller_of(context))
        except RequestError as error:
            self._router.metrics.request_refused(error.code.name)
            shown_id = request_id[:256] if request_id.isprintable() else ascii(request_id[:256])  # the client's text, maybe invalid
            log.debug("refused with %s: %s", error.code.name, error.message, extra={REQUEST_ID: shown_id})
            await abort_rpc(context, error)
        log.debug("accepted: %d prompt tokens, max_tokens %d", handle.request.num_prompt_tokens, handle.request.max_tokens,
                  extra={REQUEST_ID: request_id})
        # Runs once the handler's task is done, however it ended (a finished request is no longer
        # the engine's, and the call only wakes a handler that no longer waits).
        context.add_done_callback(lambda _: self._router.cancel(handle))
        return handle

    def _validate(self, request: prepare_pb2.GenerateRequest, request_id: str) -> GenerationRequest:
        """The validated, tokenized request (in the executor). Raises RequestError (its status) when refused."""
        return validate_generate_request(request, request_id, self._tokenizer, self._router.model_limits())

    def _tokenize(self, request: prepare_pb2.TokenizeRequest) -> prepare_pb2.TokenizeResponse:
        """``Tokenize``'s answer (in the executor). Raises RequestError (INVALID_ARGUMENT) for a bad input."""
        ids = tokenize_prompt(self._tokenizer, prompt=request.prompt, messages=request.messages)
        return prepare_pb2.TokenizeResponse(token_ids=ids, tokens=self._tokenizer.convert_ids_to_tokens(ids), count=len(ids))

    async def _events(self, handle: RequestHandle, context: grpc.aio.ServicerContext) -> AsyncIterator[reclaim_pb2.SequenceEvent]:
        """The request's events, each fed to its observer first; a terminal error aborts the RPC
        with its status; a handler that ends without a terminal tells the observer the client left."""
        observer = handle.observer
        try:
            async with aclosing(handle.events_async(self._waker)) as events:
                async for event in events:
                    observer.on_event(event)
                    yield event
        except RequestError as error:
            observer.on_error(error.code.name)
            log.info("failed with %s: %s", error.code.name, error.message, extra={REQUEST_ID: handle.request.request_id})
            await abort_rpc(context, error)
        finally:
            # Ignored after a terminal; else the client left first (the task was cancelled). A
            # client whose deadline passes cancels the call a little before the server's copy of
            # the deadline (the server's starts when the request arrives), hence the slack.
            remaining = context.time_remaining()
            observer.on_client_gone(deadline_passed=remaining is not None and remaining < DEADLINE_SLACK_S)
