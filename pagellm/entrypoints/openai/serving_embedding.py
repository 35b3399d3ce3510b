"""POST /v1/embeddings (OpenAI's shape): texts or token ids, one or a batch -> one vector each, as floats or as
base64 of little-endian float32 (what the openai SDK asks for by default). Each input is a pooling request of the
engine (AsyncLLM.encode), prefilled in the same batches as generations. `PoolingServing` is what the score and
rerank endpoints share with it: validating prompts and running a batch of pooling requests."""
from __future__ import annotations

import base64
import uuid
from typing import cast

import numpy as np

from pagellm.entrypoints.openai.errors import OpenAIServingError
from pagellm.entrypoints.openai.protocol_pooling import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    EmbeddingUsage,
)
from pagellm.entrypoints.openai.serving_engine import OpenAIServing, TokensPrompt
from pagellm.entrypoints.utils import merge_async_iterators
from pagellm.exceptions import InvalidRequestError
from pagellm.outputs import PoolingRequestOutput
from pagellm.pooling_params import PoolingParams


class PoolingServing(OpenAIServing):
    async def prompts(self, inputs: str | list[str] | list[int] | list[list[int]], param: str,
                      add_special_tokens: bool = True) -> list[TokensPrompt]:
        """The request's prompts (one text or token-id list, or a batch of either), each checked here so that a
        bad one is a 400 naming `param`: not empty, ids in the vocabulary, no longer than max_model_len."""
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            batch = [cast(str | list[int], inputs)]
        else:
            batch = list(cast(list[str] | list[list[int]], inputs))
        if not batch:
            raise OpenAIServingError(f"{param} must not be empty: give a text, a list of texts or token ids.",
                                     param=param)
        return [self.checked(await self.text_prompt(item, add_special_tokens, param) if isinstance(item, str)
                             else {"prompt": None, "prompt_token_ids": list(item)}, param)
                for item in batch]

    def checked(self, prompt: TokensPrompt, param: str) -> TokensPrompt:
        """The prompt, once the engine's checks of its tokens pass (a 400 naming `param` otherwise)."""
        try:
            self.engine.frontend.input_processor.validate_prompt_tokens(prompt["prompt_token_ids"])
        except InvalidRequestError as exc:
            raise OpenAIServingError(f"{param}: {exc}", param=param) from None
        return prompt

    async def encode_batch(self, prompts: list[TokensPrompt], params: list[PoolingParams], request_id: str,
                           priority: int, param: str) -> list[PoolingRequestOutput]:
        """Run a pooling request per prompt together; their outputs in prompt order. A batch the server could never
        hold at once is refused (a 503 would invite retries that cannot succeed)."""
        limit = self.engine.max_requests_at_once([len(p["prompt_token_ids"]) for p in prompts], 1)
        if limit is not None and len(prompts) > limit:
            raise OpenAIServingError(f"This request has {len(prompts)} inputs, but the server holds at most {limit} "
                                     f"at once (--max-num-seqs, --kv-cache-memory and --max-waiting-requests); send "
                                     f"fewer per request.", param=param)
        streams = [self.engine.encode(prompt, p, f"{request_id}-{i}", priority)
                   for i, (prompt, p) in enumerate(zip(prompts, params))]
        outputs: list[PoolingRequestOutput | None] = [None] * len(prompts)
        merged = merge_async_iterators(*streams)
        try:
            async for index, output in merged:
                outputs[index] = output
        finally:
            await merged.aclose()
        return cast(list[PoolingRequestOutput], outputs)


class OpenAIServingEmbedding(PoolingServing):
    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        model = self.base_model_name(request.model)
        prompts = await self.prompts(request.input, "input", request.add_special_tokens)
        # The engine checks dimensions against the hidden size (a 400 naming the field).
        params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
        request_id = f"embd-{uuid.uuid4().hex}"
        outputs = await self.encode_batch(prompts, [params] * len(prompts), request_id, request.priority, "input")
        data = [EmbeddingResponseData(index=i, embedding=encode_vector(output.outputs.data.numpy(),
                                                                       request.encoding_format))
                for i, output in enumerate(outputs)]
        num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return EmbeddingResponse(id=request_id, model=model, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """Floats (float32 values, exactly), or base64 of the little-endian float32 bytes, as OpenAI sends them."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
