"""Prefill cases of bench_attention.py: configs, SDPA baselines, one prompt from scratch and a
resumed session (new tokens after a cached prefix). Shapes: Volundr-32B's attention layers."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from volundr.kernels.attention.prefill import paged_prefill_attention

H, KVH, D, BS = 40, 2, 128, 16
DT = torch.bfloat16
SCALE = D ** -0.5


def _pcfg(impl: str, m: int, n: int, w: int, s: int, **kw) -> dict:
    return dict(impl=impl, block_m=m, block_n=n, num_warps=w, num_stages=s, **kw)


# desc at BLOCK_N 128 holds 3 K/V stages at most in the H200's 227 KiB of shared memory (+ Q);
# warp_specialize compiles but Triton 3.6 leaves this kernel unspecialised on sm_90 (TTGIR)
PREFILL_CFGS = {
    "m128_n64_w8_s3": _pcfg("paged", 128, 64, 8, 3),
    "m128_n128_w8_s2": _pcfg("paged", 128, 128, 8, 2),
    "m128_n64_w8_s5": _pcfg("paged", 128, 64, 8, 5),
    "m64_n64_w4_s3": _pcfg("paged", 64, 64, 4, 3),
    "phased_m128_n128_w8_s3": _pcfg("phased", 128, 128, 8, 3),
    "desc_m128_n128_w8_s2": _pcfg("desc", 128, 128, 8, 2),
    "desc_m128_n128_w8_s3": _pcfg("desc", 128, 128, 8, 3),
    "desc_m128_n64_w8_s3": _pcfg("desc", 128, 64, 8, 3),
    "desc_m128_n64_w8_s5": _pcfg("desc", 128, 64, 8, 5),
    "desc_ws_m128_n128_w8_s2": _pcfg("desc", 128, 128, 8, 2, warp_specialize=True),
}


def sdpa_ms(q, k, v, backend, gqa: bool, mask=None) -> float | None:
    """Median ms of causal SDPA forced to `backend` (None: PyTorch's own choice); mask: an
    attention bias (e.g. causal_lower_right) instead of is_causal."""
    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=mask is None,
                                                attn_mask=mask, enable_gqa=gqa)
    try:
        with sdpa_kernel([backend]) if backend else contextlib.nullcontext():
            fn()
            return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    except RuntimeError:
        return None


def _inputs(T: int, prefix: int):
    """One sequence of T new tokens after `prefix` cached ones, over a shuffled paged cache:
    the kernel's arguments, and K/V in token order [prefix + T, KVH, D]. The new tokens' K/V
    are column slices of one buffer (strided rows, like the engine's split of the fused QKV)."""
    L = prefix + T
    q = torch.randn(T, H, D, device="cuda", dtype=DT)
    kc = torch.randn(triton.cdiv(L, BS), BS, KVH, D, device="cuda", dtype=DT)
    vc = torch.randn_like(kc)
    bt = torch.randperm(kc.shape[0], device="cuda").int().view(1, -1)
    cu = torch.tensor([0, T], device="cuda", dtype=torch.int32)
    ctx = torch.tensor([L], device="cuda", dtype=torch.int32)
    ks, vs = (c[bt[0].long()].reshape(-1, KVH, D)[:L] for c in (kc, vc))
    kv = torch.stack([x[prefix:].reshape(T, KVH * D) for x in (ks, vs)], 1)
    k_new, v_new = (x.view(T, KVH, D) for x in kv.view(T, 2 * KVH * D).split(KVH * D, 1))
    return (q, kc, vc, bt, cu, ctx, SCALE, T, k_new, v_new), ks, vs


def _time_cfgs(cfgs, args, ref, flops: float, base: dict, label: str, **keys) -> list[dict]:
    """Each config of paged_prefill_attention(*args): checked against ref, then timed against
    the best SDPA time of base. One config that does not compile, fit or match is reported
    and skipped, it does not end the run."""
    rows, best = [], min(base, key=base.get)
    for name, kw in cfgs.items():
        fn = functools.partial(paged_prefill_attention, *args, **kw)
        try:
            err = ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 1.5e-2, f"rel err {err}"
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        except Exception as e:  # noqa: BLE001
            rows.append(dict(**keys, cfg=name, failed=f"{type(e).__name__}: {e}"[:2000]))
            print(f"prefill {label} {name:24s} FAILED {rows[-1]['failed'][:300]}", flush=True)
            torch.cuda.synchronize()
            continue
        r = dict(**keys, cfg=name, ms=ms, tflops=flops / ms / 1e9, sdpa_best=best,
                 sdpa_ms=base[best], sdpa_tflops=flops / base[best] / 1e9,
                 ratio=base[best] / ms, ratio_default=base.get("DEFAULT", float("nan")) / ms,
                 sdpa_all_ms=base, rel_err=err)
        rows.append(r)
        print(f"prefill {label} {name:24s} {ms:8.2f} ms {r['tflops']:6.1f} TFLOP/s"
              f" | SDPA {best} {base[best]:.2f} ms {r['sdpa_tflops']:.1f}"
              f" -> ratio {r['ratio']:.2f} (vs default SDPA {r['ratio_default']:.2f})",
              flush=True)
    return rows


def bench_prefill(cfgs, lengths):
    """A prompt from scratch: causal FLOPs 2 T^2 H D, against SDPA is_causal (every backend,
    K/V expanded to the query heads or enable_gqa; best taken)."""
    rows = []
    for T in lengths:
        args, ks, vs = _inputs(T, 0)
        # SDPA layout [1, heads, T, D]
        qs = args[0].transpose(0, 1).unsqueeze(0).contiguous()
        ks, vs = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (ks, vs))
        kx, vx = ks.repeat_interleave(H // KVH, 1), vs.repeat_interleave(H // KVH, 1)
        base = {}
        for be in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                   SDPBackend.EFFICIENT_ATTENTION):
            for gqa in (False, True):
                ms = sdpa_ms(qs, ks if gqa else kx, vs if gqa else vx, be, gqa)
                if ms is not None:
                    base[f"{be.name if be else 'DEFAULT'}{'_gqa' if gqa else ''}"] = ms
        ref = F.scaled_dot_product_attention(qs, kx, vx, is_causal=True)[0].transpose(0, 1)
        rows += _time_cfgs(cfgs, args, ref, 2.0 * T * T * H * D, base, f"T={T:6d}", T=T)
        torch.cuda.empty_cache()
    return rows


def bench_prefill_prefix(cfgs, prefix: int, news: list[int]):
    """A resumed session: T new tokens after `prefix` cached ones (one sequence). FLOPs count
    the visible pairs, 4 H D (T prefix + T^2 / 2); the baseline is SDPA with a bottom-right
    causal mask (torch.nn.attention.bias.causal_lower_right), every backend, best taken."""
    from torch.nn.attention.bias import causal_lower_right

    rows = []
    for T in news:
        args, ks, vs = _inputs(T, prefix)
        qs = args[0].transpose(0, 1).unsqueeze(0).contiguous()
        kx, vx = (x.transpose(0, 1).unsqueeze(0).repeat_interleave(H // KVH, 1).contiguous()
                  for x in (ks, vs))
        mask = causal_lower_right(T, prefix + T)
        base = {}
        for be in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                   SDPBackend.EFFICIENT_ATTENTION):
            ms = sdpa_ms(qs, kx, vx, be, False, mask)
            if ms is not None:
                base[be.name if be else "DEFAULT"] = ms
        ref = F.scaled_dot_product_attention(qs, kx, vx, attn_mask=mask)[0].transpose(0, 1)
        flops = 4.0 * H * D * (T * prefix + T * T / 2)
        rows += _time_cfgs(cfgs, args, ref, flops, base, f"prefix {prefix} + T={T:5d}",
                           prefix=prefix, T=T)
        torch.cuda.empty_cache()
    return rows
