"""What both public APIs (gRPC ``stageserve.v1.Generation`` and the OpenAI-compatible HTTP one) do
with a ``GenerateRequest``, written once: validate it, submit its ``n`` choices to the router, and
hand back their events, each fed to its request's observer first.

A request with ``n > 1`` runs as ``n`` scheduler requests, one per choice, with ids
``<request_id>#<i>`` and seeds ``seed + i`` (mod 2**64): a seeded request reproduces all its choices,
and the choices differ from one another. Choices placed together each prefill the prompt (a block
enters the prefix cache only once the step that wrote it is published); a later request reuses it. The choices are
placed like any request and end independently; the request ends when the last one does.

A request id belongs to the API key that created it (its ``owner``): the scheduler knows it as
:func:`~stageserve.prepare.validation.scoped_request_id`, so the duplicate check and ``Abort`` see
only the caller's own ids, and another key's running id is simply unknown. Without keys every
id is unscoped, as before. The owner is also the request's prefix-cache tenant (its blocks are
shared only with the same key's requests) unless the deployment shares the cache across keys
(``--prefix-cache-sharing shared``): a hit would tell one tenant what another sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from dataclasses import replace
from typing import TypeVar

import grpc

from stageserve.fair_pool import FairPool
from stageserve.logs import REQUEST_ID
from stageserve.security.keys import NO_LIMITS, TenantLimits
from stageserve.prepare.embeddings import embedding_requests
from stageserve.prepare.errors import RequestError, invalid_argument
from stageserve.prepare.request_handle import LoopWaker, RequestHandle
from stageserve.prepare.router import DeviceRouter
from stageserve.prepare.limits import MAX_CHOICES, check_tokenize_bounds
from stageserve.prepare.sampling_defaults import with_defaults
from stageserve.prepare.validation import (GenerationRequest, release_freed_memory, scoped_request_id, tokenize_prompt, validate_choices,
                                           validate_generate_request)
from stageserve.v1 import common_pb2, prepare_pb2, reclaim_pb2

log = logging.getLogger(__name__)

_SEED_MASK = (1 << 64) - 1
VALIDATION_WORKERS = 8
"""Threads tokenizing and validating requests (both APIs); a 1 MiB prompt takes ~2.5 s and ~210 MB."""
VALIDATION_PER_KEY = 2
"""Of them, one API key's at once: its burst of huge prompts holds two threads and ~420 MB at most."""
T = TypeVar("T")


def choice_id(request_id: str, index: int) -> str:
    """The scheduler's id of choice ``index`` of a request with several choices."""
    return f"{request_id}#{index}"


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """``request`` itself when ``n == 1``, else its ``n`` choices (see the module docstring)."""
    if n == 1:
        return [request]
    choices = []
    for index in range(n):
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.seed = (request.sampling.seed + index) & _SEED_MASK
        choices.append(replace(request, request_id=choice_id(request.request_id, index), sampling=sampling))
    return choices


class Submission:
    """The accepted choices of one request; ``handles[i]`` is choice ``i``'s.

    Attributes:
        request_id: the request's id (the client's or a generated one).
        handles: one per choice, in index order.
    """

    def __init__(self, request_id: str, handles: list[RequestHandle], router: DeviceRouter) -> None:
        self.request_id = request_id
        self.handles = handles
        self._router = router

    @property
    def num_prompt_tokens(self) -> int:
        return self.handles[0].prompt_tokens

    def cancel(self) -> None:
        """The client's call ended (however): abort the choices still running, free their KV."""
        for handle in self.handles:
            self._router.cancel(handle)

    def client_gone(self, deadline_passed: bool = False) -> None:
        """Tell each choice's observer the client left (ignored for choices that already ended)."""
        for handle in self.handles:
            handle.observer.on_client_gone(deadline_passed=deadline_passed)

    async def events(self, waker: LoopWaker) -> AsyncIterator[tuple[int, reclaim_pb2.SequenceEvent]]:
        """``(choice index, event)`` of every choice, in each choice's order, until all have ended.

        Raises:
            RequestError: a choice ended with this status instead (the other choices are then
                no longer waited for; :meth:`cancel` aborts them).
        """
        if len(self.handles) == 1:  # the common case, without a task per choice
            async for event in _observed(self.handles[0], waker):
                yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, handle: RequestHandle) -> None:
            try:
                async for event in _observed(handle, waker):
                    queue.put_nowait((index, event))
            except RequestError as error:
                queue.put_nowait(error)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i, handle)) for i, handle in enumerate(self.handles)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, RequestError):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()


async def _observed(handle: RequestHandle, waker: LoopWaker) -> AsyncIterator[reclaim_pb2.SequenceEvent]:
    """``handle``'s events, each fed to its observer first; a terminal error is counted, logged, raised."""
    try:
        async with aclosing(handle.events_async(waker)) as events:
            async for event in events:
                handle.observer.on_event(event)
                yield event
    except RequestError as error:
        handle.observer.on_error(error.code.name)
        log.info("failed with %s: %s", error.code.name, error.message, extra={REQUEST_ID: handle.request.request_id})
        raise


class GenerationFrontend:
    """Validates and submits requests for the public APIs, on ``waker``'s event loop.

    ``tokenizer`` is the served model's; tokenization runs off the loop, in the API keys' turns
    (`in_turn`), so that a long prompt holds up neither the other streams' chunks nor another key. ``sampling_defaults`` (the model's,
    ``sampling_defaults.py``) fill what a request leaves unset. ``served_names`` (``--served-model-name``)
    are the names clients know the model by, the first one shown; none: the device's model name.
    ``share_prefix_cache``: requests of different API keys share prefix-cache blocks (default: each
    key's are its own). ``tenant_limits``: each key name's limits (the keys file's).
    """

    def __init__(self, router: DeviceRouter, tokenizer, waker: LoopWaker, served_names: tuple[str, ...] = (),
                 sampling_defaults: prepare_pb2.GenerateRequest | None = None, share_prefix_cache: bool = False,
                 tenant_limits: Mapping[str, TenantLimits] | None = None) -> None:
        self.router = router
        self.share_prefix_cache = share_prefix_cache
        self.tenant_limits = tenant_limits or {}
        self.tokenizer = tokenizer
        self.waker = waker
        self.served_names = served_names
        self.sampling_defaults = sampling_defaults or prepare_pb2.GenerateRequest()
        self._work = FairPool(VALIDATION_WORKERS, VALIDATION_PER_KEY, "prepare-validation")

    def model_name(self, attach) -> str:
        """The name both APIs show for the model a device attached with (``attach``: its ``AttachReply``)."""
        return self.served_names[0] if self.served_names else attach.model_name

    async def in_turn(self, owner: str, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` (tokenization, validation) on the pool that API keys take in turns
        (`FairPool`: two of a key's tasks at a time), off the event loop."""
        return await asyncio.wrap_future(self._work.submit(owner, fn, *args))

    async def tokenize(self, request: prepare_pb2.TokenizeRequest, owner: str = "", add_special_tokens: bool = True) -> list[int]:
        """``Tokenize``'s token ids for both APIs, as ``Generate`` would see them (``add_special_tokens``
        false: a plain prompt without the tokenizer's BOS), in ``owner``'s turn.

        Raises:
            RequestError: ``INVALID_ARGUMENT`` for a bad input, one past `MAX_PROMPT_CHARS`, or one
                of more tokens than the model's context (when a device is attached).
        """
        return await self.in_turn(owner, self._tokenize, request, add_special_tokens)

    def _tokenize(self, request: prepare_pb2.TokenizeRequest, add_special_tokens: bool) -> list[int]:
        check_tokenize_bounds(request)
        if request.prompt and not add_special_tokens:
            ids = list(self.tokenizer.encode(request.prompt, add_special_tokens=False))
            release_freed_memory(len(ids))
        else:
            ids = tokenize_prompt(self.tokenizer, prompt=request.prompt, messages=request.messages)
        try:
            context = self.router.model_limits().max_model_len
        except RequestError:  # no device attached: nothing to bound the count by
            return ids
        if len(ids) > context:
            count = len(ids)
            del ids  # not kept alive by the refusal's traceback until the cyclic GC runs (~20 MB per 1 MiB prompt)
            raise invalid_argument(f"{'prompt' if request.prompt else 'messages'}: {count} tokens is more than the model's context"
                                   f" of {context} tokens; shorten it")
        return ids

    async def submit(self, request: prepare_pb2.GenerateRequest, request_id: str, caller: str = "", owner: str = "") -> Submission:
        """Validate ``request`` and place its choices; the caller must call the submission's
        :meth:`Submission.cancel` once its call ends, however it ends. If ``caller`` aborted
        ``request_id`` shortly before (:meth:`abort`), the choices end at once with ``finish_reason`` abort.
        ``owner``: the name of the API key it came with ("" without keys); the id is that key's.

        Raises:
            RequestError: the refusal (``INVALID_ARGUMENT``, ``ALREADY_EXISTS``,
                ``RESOURCE_EXHAUSTED``, ``UNAVAILABLE``); choices already placed are aborted.
        """
        scoped_id = scoped_request_id(owner, request_id)
        try:
            validated, n = await self.in_turn(owner, self._validate, request, scoped_id)
            handles = self._place(choice_requests(self._of_tenant(validated, owner), n), caller, scoped_id)
        except RequestError as error:
            self._refused(error, request_id)
            raise
        log.debug("accepted: %d prompt tokens, max_tokens %d, n %d", validated.num_prompt_tokens, validated.max_tokens, n,
                  extra={REQUEST_ID: request_id})
        return Submission(request_id, handles, self.router)

    async def embed(self, request: prepare_pb2.EmbedRequest, request_id: str, caller: str = "", owner: str = "") -> prepare_pb2.EmbedResponse:
        """Embed ``request``'s inputs (``embeddings.py``); ``caller`` and ``owner`` as in :meth:`submit`.

        Raises:
            RequestError: the refusal (``FAILED_PRECONDITION``: the device does not embed;
                ``INVALID_ARGUMENT``, ``ALREADY_EXISTS``, ``RESOURCE_EXHAUSTED``, ``UNAVAILABLE``), a
                failed input's status, or ``ABORTED`` when an input was aborted; the others are aborted then.
        """
        scoped_id = scoped_request_id(owner, request_id)
        try:
            requests = await self.in_turn(owner, self._validate_embedding, request, scoped_id)
            requests = [self._of_tenant(r, owner) for r in requests]
            submission = Submission(request_id, self._place(requests, caller, scoped_id), self.router)
        except RequestError as error:
            self._refused(error, request_id)
            raise
        vectors: list[list[float] | None] = [None] * len(requests)
        try:
            async with aclosing(submission.events(self.waker)) as events:
                async for index, event in events:
                    if event.embedding:
                        vectors[index] = list(event.embedding)
        finally:
            submission.cancel()
        if any(vector is None for vector in vectors):
            raise RequestError(grpc.StatusCode.ABORTED, f"request {request_id!r} was aborted before its embeddings were made")
        return prepare_pb2.EmbedResponse(request_id=request_id, data=[common_pb2.Embedding(values=v) for v in vectors],
                                         prompt_tokens=sum(r.num_prompt_tokens for r in requests))

    def _place(self, requests: list[GenerationRequest], caller: str, scoped_id: str) -> list[RequestHandle]:
        """Submit ``requests`` (one request's choices or inputs) to the router; all or none (RequestError).

        On the loop, with no await until the caller holds the handles: a task cancelled in between
        would leave requests running for no one.
        """
        handles: list[RequestHandle] = []
        try:
            for request in requests:
                handles.append(self.router.submit(request, caller, abort_key=scoped_id))
        except RequestError:
            for handle in handles:
                self.router.cancel(handle)
            raise
        return handles

    def _of_tenant(self, request: GenerationRequest, owner: str) -> GenerationRequest:
        """``request`` as its API key's (``owner``, "" without keys): in that key's own prefix-cache
        namespace unless the cache is shared across keys, with that key's turns and limits."""
        if not owner:
            return request
        return replace(request, tenant=owner, tenant_limits=self.tenant_limits.get(owner, NO_LIMITS),
                       cache_tenant="" if self.share_prefix_cache else owner)

    def _refused(self, error: RequestError, request_id: str) -> None:
        self.router.metrics.request_refused(error.code.name)
        shown_id = request_id[:256] if request_id.isprintable() else ascii(request_id[:256])  # the client's text, maybe invalid
        log.debug("refused with %s: %s", error.code.name, error.message, extra={REQUEST_ID: shown_id})

    def abort(self, request_id: str, caller: str = "", owner: str = "") -> bool:
        """Abort the running request ``request_id`` of ``owner`` (all its choices); ``False`` if none
        runs: then the abort is remembered for ``caller``'s request of that id registering shortly after."""
        scoped_id = scoped_request_id(owner, request_id)
        return self.router.abort([scoped_id] + [choice_id(scoped_id, i) for i in range(MAX_CHOICES)], caller)

    def _validate(self, request: prepare_pb2.GenerateRequest, request_id: str) -> tuple[GenerationRequest, int]:
        """The validated, tokenized request and its ``n`` (in the executor). Raises RequestError when refused."""
        n = validate_choices(request)
        request = with_defaults(request, self.sampling_defaults)
        return validate_generate_request(request, request_id, self.tokenizer, self.router.model_limits()), n

    def _validate_embedding(self, request: prepare_pb2.EmbedRequest, request_id: str) -> list[GenerationRequest]:
        """The embedding's scheduler requests (in the executor). Raises RequestError when refused."""
        limits = self.router.model_limits()
        return embedding_requests(request, request_id, self.tokenizer, limits, self.router.load()[0].attach.pooling)
