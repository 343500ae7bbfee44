"""The reference math agrees with itself: chunked KDA == recurrent KDA, decode with carried state
== one-shot prefill, a split causal conv == the whole, paged attention == dense causal attention.
Fresh random inputs every run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from volundr.kernels.attention.naive import naive_paged_attention, naive_store_kv
from volundr.kernels.kda.naive import (
    kda_gate,
    naive_causal_conv1d,
    naive_chunk_kda,
    naive_recurrent_kda,
)


def _kda_inputs(T: int, H: int = 3, K: int = 8, V: int = 8, B: int = 1):
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, H, V)
    g = kda_gate(torch.randn(B, T, H, K), torch.rand(H).log1p(), torch.randn(H * K) * 0.1)
    beta = torch.rand(B, T, H)
    return q, k, v, g, beta


def test_chunk_equals_recurrent_varlen_with_initial_state():
    lens = [5, 17, 1, 33]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q, k, v, g, beta = _kda_inputs(sum(lens))
    h0 = torch.randn(len(lens), 3, 8, 8)
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    for chunk in (4, 16):
        o_c, s_c = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   cu_seqlens=cu, use_qk_l2norm_in_kernel=True, chunk_size=chunk)
        torch.testing.assert_close(o_c, o_r, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s_c, s_r, atol=1e-4, rtol=1e-4)


def test_chunk_boundary_states_resume_exactly():
    q, k, v, g, beta = _kda_inputs(40)
    o, final, bounds = naive_chunk_kda(q, k, v, g, beta, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True, chunk_size=16,
                                       return_chunk_states=True)
    # Resuming from the state saved at token 32 reproduces the tail.
    o2, final2 = naive_recurrent_kda(q[:, 32:], k[:, 32:], v[:, 32:], g[:, 32:], beta[:, 32:],
                                     initial_state=bounds[0][2].unsqueeze(0),
                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o2, o[:, 32:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final2, final, atol=1e-4, rtol=1e-4)


def test_token_by_token_decode_equals_prefill():
    T = 24
    q, k, v, g, beta = _kda_inputs(T, B=2)
    o_full, s_full = naive_chunk_kda(q, k, v, g, beta, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
    state = torch.zeros(2, 3, 8, 8)
    outs = []
    for t in range(T):
        o_t, state = naive_recurrent_kda(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                         g[:, t:t + 1], beta[:, t:t + 1], initial_state=state,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o_t)
    torch.testing.assert_close(torch.cat(outs, 1), o_full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, s_full, atol=1e-4, rtol=1e-4)


def test_causal_conv_split_equals_whole_and_matches_conv1d():
    C, W, T = 6, 4, 20
    x, w = torch.randn(T, C), torch.randn(C, W)
    whole = naive_causal_conv1d(x, w, None)
    ref = F.silu(F.conv1d(F.pad(x.t().unsqueeze(0), (W - 1, 0)), w.unsqueeze(1), groups=C))
    torch.testing.assert_close(whole, ref[0].t(), atol=1e-5, rtol=1e-5)
    state = torch.zeros(1, C, W - 1)
    parts = [naive_causal_conv1d(x[s:e], w, state) for s, e in ((0, 7), (7, 8), (8, 20))]
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)


def test_paged_attention_equals_dense_causal_sdpa():
    H, KVH, D, bs, nblocks = 4, 2, 16, 4, 64
    k_cache, v_cache = torch.zeros(nblocks, bs, KVH, D), torch.zeros(nblocks, bs, KVH, D)
    perm = torch.randperm(nblocks).tolist()
    cached, new = [0, 9, 3], [6, 1, 8]           # prefix already cached, tokens this step
    tables, full_k, full_v, qs, slots = [], [], [], [], []
    for c, q_len in zip(cached, new):
        L = c + q_len
        table = [perm.pop() for _ in range((L + bs - 1) // bs)]
        tables.append(table + [0] * (8 - len(table)))
        kk, vv = torch.randn(L, KVH, D), torch.randn(L, KVH, D)
        full_k.append(kk)
        full_v.append(vv)
        slot = torch.tensor([table[p // bs] * bs + p % bs for p in range(L)])
        naive_store_kv(kk[:c], vv[:c], k_cache, v_cache, slot[:c])
        slots.append(slot[c:])
        qs.append(torch.randn(q_len, H, D))
    k_new = torch.cat([kk[c:] for kk, c in zip(full_k, cached)])
    v_new = torch.cat([vv[c:] for vv, c in zip(full_v, cached)])
    naive_store_kv(k_new, v_new, k_cache, v_cache, torch.cat(slots))
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()])
    ctx = torch.tensor([c + q for c, q in zip(cached, new)])
    o = naive_paged_attention(torch.cat(qs), k_cache, v_cache, torch.tensor(tables), cu, ctx,
                              D ** -0.5)
    for n, (c, q_len) in enumerate(zip(cached, new)):
        L = c + q_len
        kk = full_k[n].repeat_interleave(H // KVH, 1).transpose(0, 1)     # [H, L, D]
        vv = full_v[n].repeat_interleave(H // KVH, 1).transpose(0, 1)
        mask = torch.arange(L).unsqueeze(0) <= torch.arange(c, L).unsqueeze(1)
        ref = F.scaled_dot_product_attention(qs[n].transpose(0, 1), kk, vv, attn_mask=mask)
        torch.testing.assert_close(o[cu[n]:cu[n + 1]], ref.transpose(0, 1), atol=1e-5,
                                   rtol=1e-5)
