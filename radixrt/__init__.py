"""radixrt: an LLM serving runtime built around RadixAttention."""

from radixrt.config import ServerArgs
from radixrt.core.sampling_params import SamplingParams

__all__ = ["Engine", "GenerateOutput", "SamplingParams", "ServerArgs", "StreamChunk"]


def __getattr__(name: str):  # lazy: importing radixrt must not start torch in light processes
    if name in ("Engine", "GenerateOutput", "StreamChunk"):
        from radixrt import engine

        return getattr(engine, name)
    raise AttributeError(name)
