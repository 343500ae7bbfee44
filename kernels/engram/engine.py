"""What the engine calls on CUDA (volundr.ops): the in-place host-table lookup kernels."""

from volundr.kernels.engram.lookup import embedding_lookup, engram_lookup

__all__ = ["embedding_lookup", "engram_lookup"]
