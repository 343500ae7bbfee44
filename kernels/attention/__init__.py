"""Paged GQA attention: naive references (naive.py); Triton kernels are added beside them."""

from volundr.kernels.attention.naive import naive_paged_attention, naive_store_kv

__all__ = ["naive_paged_attention", "naive_store_kv"]
