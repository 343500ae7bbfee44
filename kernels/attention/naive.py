"""Reference paged attention (GQA, NoPE, causal) in plain PyTorch.

KV cache of one layer: k_cache, v_cache [num_blocks, block_size, KVH, D]. A sequence's token at
position p lives in block block_table[p // block_size], row p % block_size.
"""

from __future__ import annotations

import torch


def naive_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, KVH, D] to flat slots (block * block_size + row) [T]; -1 skips a token.
    An fp8 (e4m3fn) cache gets the values rounded, saturated at +-448."""
    nb, bs = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache in ((k, k_cache), (v, v_cache)):
        x = x[keep]
        if cache.dtype == torch.float8_e4m3fn:
            x = x.float().clamp(-448.0, 448.0)
        cache.view(nb * bs, *cache.shape[2:])[slots] = x.to(cache.dtype)


def naive_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of new tokens over each sequence's cached prefix plus themselves.

    q: [T, H, D], the new tokens of N sequences packed (cu_seqlens_q [N + 1]).
    block_tables: [N, max_blocks] int; context_lens: [N], tokens in the cache per sequence
      *including* the new ones (already stored). New token j of a sequence with q_len new
      tokens sits at position context_len - q_len + j and sees positions <= its own.
    Returns o: [T, H, D] in q.dtype (math in fp32; an fp8 cache's values as they are).
    """
    T, H, D = q.shape
    KVH, bs = k_cache.shape[2], k_cache.shape[1]
    group = H // KVH
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        if e == s:
            continue
        L = int(context_lens[n])
        nblk = (L + bs - 1) // bs
        blocks = block_tables[n, :nblk].long()
        k = k_cache[blocks].reshape(nblk * bs, KVH, D)[:L].float()     # [L, KVH, D]
        v = v_cache[blocks].reshape(nblk * bs, KVH, D)[:L].float()
        k = k.repeat_interleave(group, dim=1)                            # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        qs = q[s:e].float()                                              # [Lq, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        qpos = torch.arange(L - (e - s), L, device=q.device).unsqueeze(1)
        kpos = torch.arange(L, device=q.device).unsqueeze(0)
        scores = scores.masked_fill((kpos > qpos).unsqueeze(0), float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
