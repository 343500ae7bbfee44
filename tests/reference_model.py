"""An independent, cache-free forward of Volundr written straight from VOLUNDR.md, used to check
the engine's paged / stateful / chunked path. Whole sequences only, fp32, one at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from volundr.config import VolundrConfig
from volundr.kernels.kda.naive import naive_recurrent_kda


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _conv_silu(x, w):  # x [T, C], w [C, W]: causal depthwise conv, zeros before the start
    W = w.shape[1]
    y = F.conv1d(F.pad(x.t().unsqueeze(0), (W - 1, 0)), w.unsqueeze(1), groups=x.shape[1])
    return F.silu(y[0].t())


def _engram_hash(ids: list[int], t: int, n: int, seed: int, p: int, pad: int) -> int:
    h = seed
    for pos in range(t - n + 1, t + 1):
        tok = ids[pos] if pos >= 0 else pad
        h = ((h ^ tok) * 0x5BD1E995) % 2**32
    return h % p


def reference_logits(cfg: VolundrConfig, sd: dict[str, torch.Tensor], ids: list[int],
                     embeds: dict[int, torch.Tensor] | None = None):
    """Logits [T, vocab] of every position of `ids`; `embeds` (position -> vector) replace the
    embedding rows of those positions."""
    W = {k: v.float() for k, v in sd.items()}
    eps, T = cfg.rms_norm_eps, len(ids)
    h = W["model.embed_tokens.weight"][torch.tensor(ids)]
    for pos, vec in (embeds or {}).items():
        h[pos] = vec.float()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if i in cfg.engram.layers:
            e, rows = cfg.engram, []
            j = 0
            for n in e.ngram_orders:
                for _ in range(e.heads_per_order):
                    r = [_engram_hash(ids, t, n, e.hash_seeds[j], e.table_sizes[j], e.pad_id)
                         for t in range(T)]
                    rows.append(W[f"{p}engram.tables.{j}"][torch.tensor(r)])
                    j += 1
            emb = torch.cat(rows, -1)
            k, v = emb @ W[f"{p}engram.k_proj.weight"].t(), emb @ W[f"{p}engram.v_proj.weight"].t()
            a = torch.sigmoid((_rms(h, W[f"{p}engram.h_norm.weight"], eps)
                               * _rms(k, W[f"{p}engram.k_norm.weight"], eps)).sum(-1, True)
                              / cfg.hidden_size ** 0.5)
            u = a * v
            h = h + u + _conv_silu(_rms(u, W[f"{p}engram.u_norm.weight"], eps),
                                   W[f"{p}engram.conv1d.weight"])
        x = _rms(h, W[p + "input_layernorm.weight"], eps)
        if cfg.is_attention(i):
            a = p + "self_attn."
            H, KVH, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            q = (x @ W[a + "q_proj.weight"].t()).view(T, H, D).transpose(0, 1)
            k = (x @ W[a + "k_proj.weight"].t()).view(T, KVH, D).transpose(0, 1)
            v = (x @ W[a + "v_proj.weight"].t()).view(T, KVH, D).transpose(0, 1)
            k, v = k.repeat_interleave(H // KVH, 0), v.repeat_interleave(H // KVH, 0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out = o.transpose(0, 1).reshape(T, H * D) @ W[a + "o_proj.weight"].t()
        else:
            a, c = p + "kda.", cfg.kda
            H, K = c.num_heads, c.head_dim

            q, k, v = (_conv_silu(x @ W[f"{a}{n}_proj.weight"].t(), W[f"{a}{n}_conv1d.weight"])
                       .view(1, T, H, K) for n in "qkv")
            graw = (x @ W[a + "f_a_proj.weight"].t() @ W[a + "f_b_proj.weight"].t()).view(T, H, K)
            g = -W[a + "A_log"].exp().unsqueeze(-1) * F.softplus(
                graw + W[a + "dt_bias"].view(H, K))
            beta = torch.sigmoid(x @ W[a + "b_proj.weight"].t())
            qn, kn = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
            o, _ = naive_recurrent_kda(qn, kn, v, g.unsqueeze(0), beta.unsqueeze(0),
                                       scale=K ** -0.5)
            o = _rms(o[0], W[a + "o_norm.weight"], eps)
            gate = torch.sigmoid(x @ W[a + "g_a_proj.weight"].t() @ W[a + "g_b_proj.weight"].t())
            out = (o.reshape(T, H * K) * gate) @ W[a + "o_proj.weight"].t()
        h = h + out
        x = _rms(h, W[p + "post_attention_layernorm.weight"], eps)
        m = p + "mlp."
        h = h + (F.silu(x @ W[m + "gate_proj.weight"].t()) * (x @ W[m + "up_proj.weight"].t())
                 ) @ W[m + "down_proj.weight"].t()
    return _rms(h, W["model.norm.weight"], eps) @ W["lm_head.weight"].t()
