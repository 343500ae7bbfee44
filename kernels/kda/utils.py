"""Helpers shared by the KDA Triton kernels: gate activation, layout checks, varlen chunk maps."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# log2(e): the kernels keep log decays in base 2 and use exp2
RCP_LN2 = tl.constexpr(1.4426950408889634)


@triton.jit
def softplus(x):
    # torch.nn.functional.softplus with its default threshold of 20
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def kda_gate_act(g, A_log, dt_bias, i_h, o_k, m_k, K: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """-exp(A_log[h]) * softplus(g + dt_bias[h * K + k]) for a [..., BK] tile of raw gate logits."""
    if HAS_DT_BIAS:
        g = g + tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    return -tl.exp(tl.load(A_log + i_h).to(tl.float32)) * softplus(g)


def token_strides(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """x [B, T, H, D] (or [B, T, H]: beta) -> (x', stride of one token, stride of one head) with
    tokens of all batches addressable as (b * T + t) * stride_t and a contiguous last dim; copies
    only when the layout does not allow that."""
    B, T = x.shape[:2]
    if x.stride(-1) != 1 or (B > 1 and x.stride(0) != T * x.stride(1)):
        x = x.contiguous()
    return x, x.stride(1), x.stride(2)


def seq_bounds(cu_seqlens: torch.Tensor | None, cu_seqlens_cpu, B: int, T: int) -> list[int]:
    """Host list of sequence boundaries: cu_seqlens, or [0, T, 2T, ...] for B equal sequences."""
    if cu_seqlens is None:
        return [b * T for b in range(B + 1)]
    if B != 1:
        raise ValueError("cu_seqlens needs B == 1 (sequences packed along T)")
    if cu_seqlens_cpu is not None:
        return [int(c) for c in cu_seqlens_cpu]
    return cu_seqlens.tolist()


def chunk_maps(cu: list[int], BT: int, device, with_cu: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """Per chunk (sequence, chunk in it) [NT, 2], per sequence its first chunk [N], NT, and
    (with_cu) cu itself as a device tensor [N + 1]; int32.

    One host->device copy from pinned memory: a copy from pageable memory makes the host wait
    for the stream to drain first, so the GPU would idle while the next launches are issued
    (H200 run 55, T = 32K: ~0.6 ms between the launches of a 5.4 ms prefill)."""
    idx, offs = [], []
    for n in range(len(cu) - 1):
        offs.append(len(idx) // 2)
        for c in range(triton.cdiv(cu[n + 1] - cu[n], BT)):
            idx += [n, c]
    nt = len(idx) // 2
    host = torch.tensor(idx + offs + (cu if with_cu else []), dtype=torch.int32)
    if torch.device(device).type == "cuda":
        # (the caching host allocator keeps the pinned block until the copy is done)
        host = host.pin_memory()
    both = host.to(device, non_blocking=True)
    n = len(cu) - 1
    cu_t = both[2 * nt + n:] if with_cu else None
    return both[:2 * nt].view(nt, 2), both[2 * nt:2 * nt + n], nt, cu_t
