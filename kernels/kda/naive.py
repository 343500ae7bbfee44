"""Reference math for Kimi Delta Attention (KDA), in plain PyTorch.

Shapes follow flash-linear-attention (`fla.ops.kda`):
  q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] (log decay, <= 0); beta: [B, T, H]
  initial_state / final state: [N, H, K, V] in fp32, N = B, or the number of sequences when
  `cu_seqlens` ([N + 1], int) packs N variable-length sequences into B = 1.

Recurrence per head, S of shape [K, V]:
  S = Diag(exp(g_t)) S;  S = S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale * q_t)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (fla's l2norm)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None):
    """g = -exp(A_log[h]) * softplus(g_raw + dt_bias).  g_raw: [..., H, K]; A_log: [H]."""
    x = g_raw.float()
    if dt_bias is not None:
        x = x + dt_bias.float().view(x.shape[-2], x.shape[-1])
    return -A_log.float().exp().unsqueeze(-1) * F.softplus(x)


def _split(cu_seqlens: torch.Tensor | None, B: int, T: int) -> list[tuple[int, int, int]]:
    """(batch index, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    if B != 1:
        raise ValueError("cu_seqlens needs B == 1 (sequences packed along T)")
    cu = cu_seqlens.tolist()
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def naive_recurrent_kda(q, k, v, g, beta, scale: float | None = None, initial_state=None,
                        output_final_state: bool = False, cu_seqlens=None,
                        use_qk_l2norm_in_kernel: bool = False):
    """Token-by-token KDA. Returns (o [B, T, H, V] in v.dtype, final state [N, H, K, V] | None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k, v, g, beta = q.float(), k.float(), v.float(), g.float(), beta.float()
    seqs = _split(cu_seqlens, B, T)
    o = torch.zeros(B, T, H, V, dtype=torch.float32, device=q.device)
    finals = []
    for n, (b, s, e) in enumerate(seqs):
        S = (initial_state[n].float().clone() if initial_state is not None
             else torch.zeros(H, K, V, dtype=torch.float32, device=q.device))
        for t in range(s, e):
            S = S * g[b, t].exp().unsqueeze(-1)                       # [H, K, V]
            kt, vt = k[b, t], v[b, t]                                 # [H, K], [H, V]
            u = beta[b, t].unsqueeze(-1) * (vt - torch.einsum("hkv,hk->hv", S, kt))
            S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
            o[b, t] = torch.einsum("hkv,hk->hv", S, q[b, t] * scale)
        finals.append(S)
    final = torch.stack(finals) if output_final_state else None
    return o.to(out_dtype), final


def naive_chunk_kda(q, k, v, g, beta, scale: float | None = None, initial_state=None,
                    output_final_state: bool = False, cu_seqlens=None,
                    use_qk_l2norm_in_kernel: bool = False, chunk_size: int = 16,
                    return_chunk_states: bool = False):
    """KDA over chunks of `chunk_size` tokens, the same math as the recurrent form.

    Within a chunk, with G = cumsum(g) and S0 the state at its start, the delta-rule
    pseudo-values U solve the unit lower-triangular system
        (I + Diag(beta) A) U = Diag(beta) (V - (K * exp(G)) S0),
        A[t, i] = sum_c k_t[c] k_i[c] exp(G_t[c] - G_i[c])  for i < t,
    then o_t = S0^T (exp(G_t) * q_t) + sum_{i<=t} u_i <q_t * exp(G_t - G_i), k_i>, and
    S_end = Diag(exp(G_C)) S0 + sum_i (exp(G_C - G_i) * k_i) u_i^T.

    With `return_chunk_states`, also returns the state at every chunk boundary of every
    sequence (a list per sequence of [H, K, V], the state before each chunk) for prefix caching.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k, v, g, beta = q.float(), k.float(), v.float(), g.float(), beta.float()
    o = torch.zeros(B, T, H, V, dtype=torch.float32, device=q.device)
    finals, boundaries = [], []
    for n, (b, s, e) in enumerate(_split(cu_seqlens, B, T)):
        S = (initial_state[n].float().clone() if initial_state is not None
             else torch.zeros(H, K, V, dtype=torch.float32, device=q.device))
        seq_bounds = []
        for c0 in range(s, e, chunk_size):
            seq_bounds.append(S.clone())
            c1 = min(c0 + chunk_size, e)
            qc, kc, vc = q[b, c0:c1].transpose(0, 1), k[b, c0:c1].transpose(0, 1), \
                v[b, c0:c1].transpose(0, 1)                            # [H, C, *]
            G = g[b, c0:c1].transpose(0, 1).cumsum(1)                 # [H, C, K]
            bc = beta[b, c0:c1].transpose(0, 1)                        # [H, C]
            C = c1 - c0
            diff = (G.unsqueeze(2) - G.unsqueeze(1))                   # [H, C(t), C(i), K]
            tri = torch.ones(C, C, dtype=torch.bool, device=q.device)
            lower = torch.tril(tri, -1)
            decay = torch.where(torch.tril(tri).unsqueeze(-1), diff, float("-inf")).exp()
            A = torch.einsum("htc,hic,htic->hti", kc, kc, decay) * lower
            rhs = bc.unsqueeze(-1) * (vc - torch.einsum("htk,hkv->htv", kc * G.exp(), S))
            M = torch.eye(C, device=q.device) + bc.unsqueeze(-1) * A
            U = torch.linalg.solve_triangular(M, rhs, upper=False, unitriangular=True)
            qs = qc * scale
            attn = torch.einsum("htc,hic,htic->hti", qs, kc, decay)   # i <= t, decay is 0 above
            oc = torch.einsum("htk,hkv->htv", qs * G.exp(), S) + attn @ U
            o[b, c0:c1] = oc.transpose(0, 1)
            GC = G[:, -1:, :]                                          # [H, 1, K]
            S = GC.transpose(1, 2).exp() * S + torch.einsum(
                "hik,hiv->hkv", (GC - G).exp() * kc, U)
        finals.append(S)
        boundaries.append(seq_bounds)
    final = torch.stack(finals) if output_final_state else None
    if return_chunk_states:
        return o.to(out_dtype), final, boundaries
    return o.to(out_dtype), final


def naive_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                        cu_seqlens: torch.Tensor | None = None, activation: str | None = "silu"):
    """Depthwise causal conv over packed sequences with a carried-in tail.

    x: [T, C] (sequences packed, split by cu_seqlens [N + 1]; one sequence if None)
    weight: [C, W] (the last tap multiplies the newest input)
    conv_state: [N, C, W - 1], the W - 1 inputs before each sequence (oldest first); updated
      in place to the last W - 1 inputs of each sequence. None means zeros and no update.
    Returns y: [T, C] in x.dtype.
    """
    T, C = x.shape
    W = weight.shape[-1]
    cu = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    y = torch.empty_like(x)
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        if s == e:  # an empty sequence keeps its tail
            continue
        tail = (conv_state[n].to(x.dtype) if conv_state is not None
                else torch.zeros(C, W - 1, dtype=x.dtype, device=x.device))
        full = torch.cat([tail, x[s:e].t()], dim=1)                   # [C, W - 1 + L]
        win = full.unfold(1, W, 1)                                     # [C, L, W]
        out = (win.float() * weight.float().unsqueeze(1)).sum(-1)      # [C, L]
        if activation == "silu":
            out = F.silu(out)
        y[s:e] = out.t().to(x.dtype)
        if conv_state is not None:
            conv_state[n].copy_(full[:, full.shape[1] - (W - 1):])
    return y
