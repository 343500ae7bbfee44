"""Kimi Delta Attention layer (the formulation of fla.layers.kda.KimiDeltaAttention).

x [T, d] -> q, k, v = SiLU(causal_conv4(W_{q,k,v} x))     (H heads of K = V channels)
         g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)   per head and key channel
         beta = sigmoid(W_b x)                                  per head
         o = KDA(l2norm(q) * K^-0.5, l2norm(k), v, g, beta)     recurrent state S [K, V] fp32
         out = W_o (RMSNorm_head(o) * sigmoid(g_b(g_a(x))))
Per sequence the layer keeps S (state slot) and the last conv_size - 1 conv inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from volundr import ops
from volundr.config import VolundrConfig
from volundr.model.batch import ForwardBatch
from volundr.model.layers import FusedLinear
from volundr.model.parallel import TP, ColumnParallelLinear, RowParallelLinear


class KDA(nn.Module):
    def __init__(self, cfg: VolundrConfig, tp: TP = TP()):
        super().__init__()
        c = cfg.kda
        # This rank's heads (all at tp == 1): every per-head tensor below is local.
        d, self.H, self.K = cfg.hidden_size, c.num_heads // tp.size, c.head_dim
        hk, r, full = self.H * self.K, c.rank, c.num_heads * c.head_dim
        self.q_proj = ColumnParallelLinear(d, full, tp)
        self.k_proj = ColumnParallelLinear(d, full, tp)
        self.v_proj = ColumnParallelLinear(d, full, tp)
        self.q_conv1d = nn.Module()
        self.k_conv1d = nn.Module()
        self.v_conv1d = nn.Module()
        for m in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            m.weight = nn.Parameter(torch.zeros(hk, c.conv_size))
        self.f_a_proj = nn.Linear(d, r, bias=False)  # low rank: replicated
        self.f_b_proj = ColumnParallelLinear(r, full, tp)
        self.A_log = nn.Parameter(torch.zeros(self.H))
        self.dt_bias = nn.Parameter(torch.zeros(hk))
        self.b_proj = ColumnParallelLinear(d, c.num_heads, tp)
        self.g_a_proj = nn.Linear(d, r, bias=False)
        self.g_b_proj = ColumnParallelLinear(r, full, tp)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(self.K))
        self.o_proj = RowParallelLinear(full, d, tp)  # all-reduces
        self.eps = cfg.rms_norm_eps
        # Bound by the ModelRunner: [slots, H, K, V] fp32 and [slots, 3 * H * K, conv - 1].
        self.state: torch.Tensor | None = None
        self.conv_state: torch.Tensor | None = None
        self.qkv_conv_weight: torch.Tensor | None = None  # set by `after_load`
        self.qkv_proj: FusedLinear | None = None

    def after_load(self) -> None:
        """The q, k and v convs as one depthwise conv over 3 * H * K channels, built once after
        the weights are in (not per step: in a decode step that cat would be a kernel per layer)."""
        self.qkv_conv_weight = torch.cat(
            [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).detach()
        self.qkv_proj = FusedLinear([self.q_proj, self.k_proj, self.v_proj])
        # the three small projections of x (two low-rank, beta): one GEMV instead of three
        self.x_proj = FusedLinear([self.f_a_proj, self.g_a_proj, self.b_proj])
        self.x_split = [self.f_a_proj.out_features, self.g_a_proj.out_features,
                        self.b_proj.out_features]
        del self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj, self.b_proj

    def forward(self, x: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        T, H, K = x.shape[0], self.H, self.K
        qkv = self.qkv_proj(x)                                            # [T, 3 * H * K]
        qkv = ops.causal_conv(qkv, self.qkv_conv_weight, self.conv_state, b.slot_ids,
                              b.cu_seqlens, activation="silu")
        q, k, v = qkv.view(T, 3, H, K).unbind(1)
        f, ga, beta = self.x_proj(x).split(self.x_split, dim=-1)
        # decay and beta stay logits: the KDA kernels apply softplus / exp / sigmoid
        o = ops.kda_mixer(q, k, v, self.f_b_proj(f).view(T, H, K), beta, self.A_log,
                          self.dt_bias, self.state, b.slot_ids, b.cu_seqlens, b.cu_list,
                          scale=K ** -0.5)                                 # [T, H, V]
        o = ops.rms_norm_gated(o, self.o_norm.weight, self.g_b_proj(ga).view(T, H, K), self.eps)
        return self.o_proj(o.reshape(T, H * K))
