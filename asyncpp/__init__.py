"""asyncpp: a pipeline-parallel LLM serving engine built as a small actor system."""

from asyncpp.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"
