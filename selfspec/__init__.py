"""selfspec: quantized self-speculative decoding from one copy of the weights."""
from selfspec.engine.llm import LLM, Generation, load
from selfspec.errors import SelfspecError
from selfspec.speculative.sampling import SamplingParams

__all__ = ["load", "LLM", "Generation", "SamplingParams", "SelfspecError"]
