"""Volundr serving engine: `from volundr import LLM, SamplingParams`."""

from volundr.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy so that `import volundr` (e.g. in the Triton stub or the converter) does not load torch.
    if name == "LLM":
        from volundr.llm import LLM

        return LLM
    raise AttributeError(name)
