"""Host-table lookups (token embedding, Engram n-gram hashing): naive reference (naive.py) and a
Triton kernel that reads pinned host memory in place from the GPU (lookup.py)."""

from volundr.kernels.engram.naive import engram_rows, naive_lookup

__all__ = ["engram_rows", "naive_lookup"]
