"""llmserve: a high-throughput LLM inference engine."""

from llmserve.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from llmserve.config import EngineConfig
from llmserve.entrypoints.llm import LLM
from llmserve.outputs import CompletionOutput, Logprob, RequestOutput
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "EngineConfig", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
