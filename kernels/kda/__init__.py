"""Kimi Delta Attention: naive references (naive.py) and Triton kernels.

Triton kernels (imported lazily, so that importing the references does not import Triton):
  chunk_kda            chunked prefill, varlen, state in/out, per-chunk states  (chunk.py)
  fused_recurrent_kda  decode / verify: token by token, state pool in place     (fused_recurrent.py)
  causal_conv1d        short depthwise causal conv with carried tail            (conv.py)
  kda_decode           decode step: conv + KDA in one launch                    (decode.py)
  kda_rows             a speculative check's rows (+ gated norm) / its commit   (rows.py)
engine.py holds the functions `volundr.ops` calls on CUDA.
"""

from volundr.kernels.kda.naive import (
    kda_gate,
    l2norm,
    naive_causal_conv1d,
    naive_chunk_kda,
    naive_recurrent_kda,
)

_LAZY = {
    "chunk_kda": "volundr.kernels.kda.chunk",
    "fused_recurrent_kda": "volundr.kernels.kda.fused_recurrent",
    "causal_conv1d": "volundr.kernels.kda.conv",
    "kda_decode": "volundr.kernels.kda.decode",
    "kda_rows": "volundr.kernels.kda.rows",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["kda_gate", "l2norm", "naive_causal_conv1d", "naive_chunk_kda", "naive_recurrent_kda",
           "chunk_kda", "fused_recurrent_kda", "causal_conv1d", "kda_decode",
           "kda_rows"]
