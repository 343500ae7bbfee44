"""Entry points the engine calls on CUDA (through volundr.ops): KV store and paged attention.

Dispatch is on host ints only (max_q_len), so the decode path stays free of host syncs.
"""

from __future__ import annotations

import torch

from volundr.kernels.attention.cache import store_kv
from volundr.kernels.attention.decode import paged_decode_attention
from volundr.kernels.attention.prefill import paged_prefill_attention

__all__ = ["store_kv", "paged_attention"]

# An fp8 cache's decode config: float16 dots and 128-token tiles (H100 run 96, perf/RESULTS.md
# session 24: batch 16 at 256K 0.76 of copy bandwidth on the fp8 bytes against 0.49 for the bf16
# cache's config; batch 1 at 256K 0.62 against 0.39).
FP8_DECODE = dict(f16=True, block_n=128)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, max_q_len: int,
                    max_context_len: int, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of the new tokens over cache + themselves; o [T, Hq, D].

    q [T, Hq, D]; k_cache/v_cache [num_blocks, block_size, KVH, D]; block_tables [N, max_blocks]
    int32; cu_seqlens_q [N + 1] int32; context_lens [N] int32 (cached tokens including the new
    ones, already stored). max_q_len / max_context_len: host ints bounding q_len / context_len.
    k_new / v_new [T, KVH, D]: the new tokens' K/V (what store_kv stored), which prefill may
    read contiguously instead of through the block table (prefill.IMPL); decode ignores them.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    if max_q_len <= 1:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                      context_lens, scale, max_context_len,
                                      **(FP8_DECODE if k_cache.element_size() == 1 else {}))
    return paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                   context_lens, scale, max_q_len, k_new, v_new)
