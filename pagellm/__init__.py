"""pagellm: a vLLM-class engine for running and serving large language models."""
from pagellm.entrypoints.llm import LLM
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
