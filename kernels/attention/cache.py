"""KV store into the paged cache: one program per new token copies its K and V rows.

Cache layout of one layer: k_cache, v_cache [num_blocks, block_size, KVH, D]; a flat slot is
block * block_size + row, so slot s lives at k_cache.view(-1, KVH, D)[s].

The cache is bf16 (the model's dtype) or fp8 e4m3 (`FP8`: half the bytes per token, so twice
the tokens in a budget and half the reads of decode attention). fp8 values are the K/V
themselves, unscaled (vLLM's default scale of 1.0), saturated to +-FP8_MAX: Volundr's K/V
rows come out of a projection of an RMS-normed stream and stay far below 448.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn


@triton.jit
def _saturate(x):
    """x in fp32, clamped to e4m3's finite range (+-FP8_MAX), as sm_90's conversion
    (satfinite) and torch's saturate."""
    return tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)


@triton.jit
def fp8_round(x):
    """x rounded to e4m3 (saturated at +-448) and back to x's dtype: the value an fp8 cache
    holds for x. (Triton's interpreter rounds wrongly across a binade, e.g. 1.96 -> 1.0; CPU
    tests use values on the fp8 grid.)"""
    return _saturate(x).to(tl.float8e4nv).to(x.dtype)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcs, stride_kch, stride_vcs, stride_vch,
                     KVH: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                     FP8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token (e.g. a CUDA-graph batch slot): nothing to store
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < KVH * D
    h = offs // D
    d = offs % D
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if FP8:
        k, v = _saturate(k), _saturate(v)
    tl.store(kc_ptr + slot * stride_kcs + h * stride_kch + d,
             k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * stride_vcs + h * stride_vch + d,
             v.to(vc_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, KVH, D] into the caches at flat slots slot_mapping [T]; -1 skips a token.
    A cache of dtype FP8 gets the values rounded to e4m3 (saturated at +-FP8_MAX).

    No host sync: safe to capture in a CUDA graph.
    """
    T, KVH, D = k.shape
    if T == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    # [num_blocks, block_size, KVH, D] -> [slots, KVH, D]; a view, so stores land in the cache
    kc = k_cache.view(-1, KVH, D)
    vc = v_cache.view(-1, KVH, D)
    assert kc.stride(-1) == 1 and vc.stride(-1) == 1, "cache head_dim must be contiguous"
    _store_kv_kernel[(T,)](
        k, v, kc, vc, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
        KVH=KVH, D=D, BLOCK=triton.next_power_of_2(KVH * D), FP8=k_cache.dtype == FP8,
        num_warps=4)
