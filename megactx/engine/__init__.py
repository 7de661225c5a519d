"""The inference engine: `LLM` (continuous batching over paged KV, chunked prefill, prefix caching)."""

from megactx.engine.llm import LLM
from megactx.engine.outputs import CompletionOutput, Delta, RequestOutput
from megactx.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Delta"]
