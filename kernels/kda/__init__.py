"""Kimi Delta Attention: naive references (naive.py); Triton kernels are added beside them."""

from volundr.kernels.kda.naive import (
    kda_gate,
    l2norm,
    naive_causal_conv1d,
    naive_chunk_kda,
    naive_recurrent_kda,
)

__all__ = ["kda_gate", "l2norm", "naive_causal_conv1d", "naive_chunk_kda", "naive_recurrent_kda"]
