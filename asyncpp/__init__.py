"""asyncpp: a pipeline-parallel LLM serving engine built as a small actor system."""

from asyncpp.sampling.params import SamplingParams

__all__ = ["AsyncClient", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: importing the client pulls in zmq, which in-process users do not need.
    if name == "AsyncClient":
        from asyncpp.client import AsyncClient

        return AsyncClient
    raise AttributeError(name)
