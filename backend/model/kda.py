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
from volundr.model.layers import (
    FusedLinear,
    GroupedLinear,
    GroupScaled,
    NextNorm,
    Normed,
    PreNorm,
    out_proj,
)
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
        self.in_proj: FusedLinear | None = None

    def after_load(self) -> None:
        """The q, k and v convs as one depthwise conv over 3 * H * K channels, built once after
        the weights are in (not per step: in a decode step that cat would be a kernel per layer);
        the six projections of x as one matmul."""
        self.qkv_conv_weight = torch.cat(
            [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).detach()
        projs = [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj,
                 self.b_proj]
        self.in_split = [m.out_features for m in projs]
        # One GEMV for all six when they share a format (every Volundr-32B checkpoint: the
        # small f_a / g_a / b rows alone ran at 93 GB/s, 0.47 ms per token); zero rows pad
        # the 4-bit total to whole 64-row kernel tiles. Otherwise q/k/v and the small three.
        fused = FusedLinear(projs, pad_to=64)
        if fused.fused is not None:
            self.in_proj, self.parts = fused, None
        else:
            self.in_proj = None
            self.parts = nn.ModuleList([FusedLinear(projs[:3]), FusedLinear(projs[3:])])
        del self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj, self.b_proj
        # f_b and g_b (rank -> H K each, on the two low-rank halves): one launch
        self.fg_b = GroupedLinear([self.f_b_proj, self.g_b_proj])
        del self.f_b_proj, self.g_b_proj

    def forward(self, x: torch.Tensor | PreNorm | Normed, b: ForwardBatch,
                post: NextNorm | None = None):
        """x [T, d], or the PreNorm / Normed of it that the input projection may fold; with
        `post`, the output may be the Normed of the next norm (`out_proj`)."""
        T, H, K = x.shape[0], self.H, self.K
        hk3 = 3 * H * K
        if self.in_proj is not None:
            y = self.in_proj(x)                              # [T, >= 3HK + 2 rank + H]
            qkv, xs = y[:, :hk3], y[:, hk3:sum(self.in_split)]  # column views
        else:
            qkv, xs = (p(x) for p in self.parts)
        r, hk = self.in_split[3], H * K
        beta = xs[:, 2 * r:]
        decode_args = (self.qkv_conv_weight, self.conv_state)
        # decay and beta stay logits: the KDA kernels apply softplus / exp / sigmoid
        if b.max_q_len == 1:  # decode: conv and recurrence in one kernel on CUDA
            # the gated output norm folded into that kernel and o_proj's GEMV where o_proj can
            fold = getattr(self.o_proj, "folds_gated_norm", None)
            gated = fold is not None and fold(qkv, K)
            fgq = self.fg_b.fused  # f_b and g_b as one mixed-bit linear, or None
            if gated and fgq is not None and ops.kda_decode_takes_low_rank(
                    qkv, T, self.qkv_conv_weight.shape[-1], fgq.bits, fgq.group_size, r):
                # and f_b / g_b too: the kernel computes the gate logits from their weights
                u, ss = ops.kda_decode(qkv, *decode_args, None, beta, self.state, b.slot_ids,
                                       b.cu_seqlens, b.cu_list, K ** -0.5, self.A_log,
                                       self.dt_bias, (None, self.o_norm.weight),
                                       low_rank=(xs[:, :2 * r], fgq.qa, fgq.sz))
                return out_proj(self.o_proj, GroupScaled(u.reshape(T, H * K), ss, self.eps),
                                post)
        fg = self.fg_b(xs[:, :2 * r].view(T, 2, r))                      # [T, 2 H K]
        f, g_out = fg[:, :hk].view(T, H, K), fg[:, hk:].view(T, H, K)
        if b.max_q_len == 1:
            gated = (g_out, self.o_norm.weight) if gated else None
            o = ops.kda_decode(qkv, *decode_args, f, beta, self.state, b.slot_ids,
                               b.cu_seqlens, b.cu_list, K ** -0.5, self.A_log, self.dt_bias,
                               gated)
            if gated is not None:  # o w sigmoid(gate), and each head's sums of squares
                u, ss = o
                return out_proj(self.o_proj, GroupScaled(u.reshape(T, H * K), ss, self.eps),
                                post)
        elif b.stash is not None and self._rows_fit(qkv, b):  # a check: conv + KDA, one launch
            # (and the gated output norm, its per-head scale left to o_proj, where it folds it)
            fold = getattr(self.o_proj, "folds_gated_norm", None)
            gated = (g_out, self.o_norm.weight) if fold is not None and fold(qkv, K) else None
            o = ops.kda_rows(qkv, *decode_args, f, beta, self.state, b.slot_ids, b.cu_seqlens,
                             K ** -0.5, self.A_log, self.dt_bias, gated=gated)
            b.stash.append((self, (qkv, f, beta)))
            if gated is not None:
                u, ss = o
                return out_proj(self.o_proj, GroupScaled(u.reshape(T, H * K), ss, self.eps),
                                post)
        else:
            o = self._mix(qkv, f, beta, b, update=b.stash is None)
            if b.stash is not None:
                b.stash.append((self, (qkv, f, beta)))
        o = ops.rms_norm_gated(o, self.o_norm.weight, g_out, self.eps)
        return out_proj(self.o_proj, o.reshape(T, H * K), post)

    def _mix(self, qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, b: ForwardBatch,
             update: bool) -> torch.Tensor:
        """conv + SiLU and the recurrence over raw qkv [T, 3HK], gate logits f [T, H, K], beta
        logits [T, H]; o [T, H, V]. update False: the states are read only (a check)."""
        T, H, K = qkv.shape[0], self.H, self.K
        few = b.max_q_len if b.rows is not None else None  # a check's few tokens
        y = ops.causal_conv(qkv, self.qkv_conv_weight, self.conv_state, b.slot_ids,
                            b.cu_seqlens, activation="silu", update_state=update, max_len=few)
        q, k, v = y.view(T, 3, H, K).unbind(1)
        return ops.kda_mixer(q, k, v, f, beta, self.A_log, self.dt_bias, self.state, b.slot_ids,
                             b.cu_seqlens, b.cu_list, scale=K ** -0.5, update_state=update)

    def commit(self, inputs: tuple, b: ForwardBatch) -> None:
        """The states advanced over a check's tokens that b's sequences keep (ModelRunner.commit):
        `inputs` as the check stashed them, rows as laid out then."""
        if self._rows_fit(inputs[0], b):
            qkv, f, beta = inputs
            ops.kda_rows(qkv, self.qkv_conv_weight, self.conv_state, f, beta, self.state,
                         b.slot_ids, b.cu_seqlens, self.K ** -0.5, self.A_log, self.dt_bias,
                         update=True)
            return
        self._mix(*inputs, b, update=True)

    def _rows_fit(self, x: torch.Tensor, b: ForwardBatch) -> bool:
        """A check's rows (or its commit's: check_layout, each sequence and its gap) that
        `ops.kda_rows` takes."""
        return b.rows is not None and ops.kda_rows_fit(
            x, b.max_q_len, self.qkv_conv_weight.shape[-1], self.K)
