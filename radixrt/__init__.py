"""radixrt: an LLM serving runtime built around RadixAttention."""

from radixrt.config import ServerArgs
from radixrt.core.sampling_params import SamplingParams

__all__ = ["Engine", "EngineDeadError", "GenerateOutput", "SamplingParams", "ServerArgs",
           "StreamChunk"]

_FRONTEND = ("Engine", "EngineDeadError", "GenerateOutput", "StreamChunk")


def __getattr__(name: str):
    # Lazy, so `import radixrt` (e.g. for ServerArgs / SamplingParams) stays cheap: the Engine
    # loads transformers, and launching a runtime imports the scheduler (torch, model code).
    if name in _FRONTEND:
        from radixrt.frontend import engine

        return getattr(engine, name)
    raise AttributeError(name)
