"""pagellm: a vLLM-class engine for running and serving large language models."""
from pagellm.beam_search import BeamSearchOutput, BeamSearchSequence
from pagellm.entrypoints.llm import LLM
from pagellm.exceptions import InvalidRequestError, RequestFailedError
from pagellm.outputs import (
           CompletionOutput,
           EmbeddingOutput,
           EmbeddingRequestOutput,
           Logprob,
           PoolingRequestOutput,
           RequestOutput,
)
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "Logprob",
           "BeamSearchOutput", "BeamSearchSequence", "InvalidRequestError", "RequestFailedError", "PoolingParams",
           "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "__version__"]
