"""Embeddings for both public APIs (gRPC ``Embed``, OpenAI's ``/v1/embeddings``): each input is one
scheduler request through the same pipeline as a generation.

An input runs as a prefill whose sequence carries the device's pooling (``SequenceStart.pooling``,
the model's: sentence-transformers' or GGUF's, else the last token, as vLLM pools a causal LM). The
device adds each chunk's final-normed hidden states to the sequence's pooled sum on the device and
outputs the L2-normalised vector with the prompt's last chunk, whose one sampled token ends the
request (``max_tokens`` 1; the token is not shown). The prefill is continuous-batched with the
generations like any other: nothing on the step path waits for it. A mean-pooled input never starts
from the prefix cache (the cached tokens' hidden states are not at hand); a last-token one may.

The inputs of one call are placed like a request's choices (ids ``<request_id>#<i>``) and end together.
"""

from __future__ import annotations

from dataclasses import replace

import grpc

from stageserve.prepare.errors import RequestError, invalid_argument
from stageserve.prepare.limits import MAX_EMBEDDING_INPUTS
from stageserve.prepare.validation import GenerationRequest, ModelLimits, validate_generate_request
from stageserve.v1 import common_pb2, prepare_pb2


def embedding_requests(request: prepare_pb2.EmbedRequest, request_id: str, tokenizer, limits: ModelLimits,
                       pooling: int) -> list[GenerationRequest]:
    """One scheduler request per input of ``request`` (ids ``<request_id>#<i>``), pooled by ``pooling``.

    Raises:
        RequestError: ``FAILED_PRECONDITION`` when the device does not embed (``pooling`` NONE);
            ``INVALID_ARGUMENT`` naming the input when there is not exactly one kind of input, none
            or more than ``MAX_EMBEDDING_INPUTS``, an empty one, or one past the context.
    """
    if pooling == common_pb2.POOLING_NONE:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "this server's device does not serve embeddings (it runs with"
                           " speculative decoding, or the model's pooling is not mean or last); use a device without them")
    if bool(request.input) == bool(request.input_token_ids):
        raise invalid_argument("input: set exactly one of input (texts) and input_token_ids")
    inputs = [prepare_pb2.GenerateRequest(prompt=text) for text in request.input] or [
        prepare_pb2.GenerateRequest(prompt_token_ids=ids.token_ids) for ids in request.input_token_ids]
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise invalid_argument(f"input: {len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS} are allowed per request")
    requests = []
    for index, prompt in enumerate(inputs):
        if not (prompt.prompt or prompt.prompt_token_ids):
            raise invalid_argument(f"input[{index}]: empty; every input needs at least one token")
        prompt.max_tokens, prompt.temperature = 1, 0.0  # the one token that ends the prefill
        try:
            validated = validate_generate_request(prompt, f"{request_id}#{index}", tokenizer, limits)
        except RequestError as error:  # name the input the message is about
            raise invalid_argument(f"input[{index}]: {error.message}") from None
        requests.append(replace(validated, pooling=pooling))
    return requests
