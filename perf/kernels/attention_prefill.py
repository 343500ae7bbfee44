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


def sdpa_ms(q, k, v, backend, gqa: bool) -> float | None:
    """Median ms of causal SDPA forced to `backend` (None: PyTorch's own choice)."""
    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    try:
        if backend is None:
            fn()
            return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        with sdpa_kernel([backend]):
            fn()
            return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    except RuntimeError:
        return None


def bench_prefill(cfgs, lengths):
    rows = []
    for T in lengths:
        flops = 2.0 * T * T * H * D
        q = torch.randn(T, H, D, device="cuda", dtype=DT)
        kc = torch.randn(T // BS, BS, KVH, D, device="cuda", dtype=DT)
        vc = torch.randn_like(kc)
        bt = torch.randperm(T // BS, device="cuda").int().view(1, -1)
        cu = torch.tensor([0, T], device="cuda", dtype=torch.int32)
        ctx = torch.tensor([T], device="cuda", dtype=torch.int32)
        # the new tokens' K/V in token order as column slices of one buffer: strided rows, like
        # the engine's split of the fused QKV projection
        kv = torch.stack([c[bt[0].long()].reshape(T, KVH * D) for c in (kc, vc)], 1)
        k_new, v_new = (x.view(T, KVH, D) for x in kv.view(T, 2 * KVH * D).split(KVH * D, 1))
        # SDPA layout [1, heads, T, D]; K/V in token order
        qs = q.transpose(0, 1).unsqueeze(0).contiguous()
        ks = kc[bt[0].long()].reshape(T, KVH, D).transpose(0, 1).unsqueeze(0).contiguous()
        vs = vc[bt[0].long()].reshape(T, KVH, D).transpose(0, 1).unsqueeze(0).contiguous()
        kx, vx = ks.repeat_interleave(H // KVH, 1), vs.repeat_interleave(H // KVH, 1)
        base = {}
        for be in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                   SDPBackend.EFFICIENT_ATTENTION):
            for gqa in (False, True):
                ms = sdpa_ms(qs, ks if gqa else kx, vs if gqa else vx, be, gqa)
                if ms is not None:
                    base[f"{be.name if be else 'DEFAULT'}{'_gqa' if gqa else ''}"] = ms
        best = min(base, key=base.get)
        ref = F.scaled_dot_product_attention(qs, kx, vx, is_causal=True)[0].transpose(0, 1)
        for name, kw in cfgs.items():
            fn = functools.partial(paged_prefill_attention, q, kc, vc, bt, cu, ctx, SCALE, T,
                                   k_new, v_new, **kw)
            try:  # one config that does not compile, fit or match must not end the run
                err = ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < 1.5e-2, f"rel err {err}"
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            except Exception as e:  # noqa: BLE001
                rows.append(dict(T=T, cfg=name, failed=f"{type(e).__name__}: {e}"[:2000]))
                print(f"prefill T={T:6d} {name:24s} FAILED {rows[-1]['failed'][:300]}",
                      flush=True)
                torch.cuda.synchronize()
                continue
            rows.append(dict(T=T, cfg=name, ms=ms, tflops=flops / ms / 1e9,
                             sdpa_best=best, sdpa_ms=base[best],
                             sdpa_tflops=flops / base[best] / 1e9,
                             ratio=base[best] / ms, ratio_default=base["DEFAULT"] / ms,
                             sdpa_all_ms=base, rel_err=err))
            print(f"prefill T={T:6d} {name:24s} {ms:8.2f} ms {rows[-1]['tflops']:6.1f} TFLOP/s"
                  f" | SDPA {best} {base[best]:.2f} ms {rows[-1]['sdpa_tflops']:.1f}"
                  f" -> ratio {rows[-1]['ratio']:.2f} (vs default SDPA "
                  f"{rows[-1]['ratio_default']:.2f})", flush=True)
        torch.cuda.empty_cache()
    return rows


def bench_prefill_prefix(cfgs, prefix: int, news: list[int]):
    """A resumed session: T new tokens after `prefix` cached ones (one sequence). FLOPs count
    the visible pairs, 4 H D (T prefix + T^2 / 2); the baseline is SDPA with a bottom-right
    causal mask (torch.nn.attention.bias.causal_lower_right), every backend, best taken."""
    from torch.nn.attention.bias import causal_lower_right

    rows = []
    for T in news:
        L = prefix + T
        flops = 4.0 * H * D * (T * prefix + T * T / 2)
        q = torch.randn(T, H, D, device="cuda", dtype=DT)
        kc = torch.randn(triton.cdiv(L, BS), BS, KVH, D, device="cuda", dtype=DT)
        vc = torch.randn_like(kc)
        bt = torch.randperm(kc.shape[0], device="cuda").int().view(1, -1)
        cu = torch.tensor([0, T], device="cuda", dtype=torch.int32)
        ctx = torch.tensor([L], device="cuda", dtype=torch.int32)
        ks, vs = (c[bt[0].long()].reshape(-1, KVH, D)[:L] for c in (kc, vc))  # token order
        kv = torch.stack([x[prefix:].reshape(T, KVH * D) for x in (ks, vs)], 1)
        k_new, v_new = (x.view(T, KVH, D) for x in kv.view(T, 2 * KVH * D).split(KVH * D, 1))
        qs = q.transpose(0, 1).unsqueeze(0).contiguous()
        kx, vx = (x.transpose(0, 1).unsqueeze(0).repeat_interleave(H // KVH, 1).contiguous()
                  for x in (ks, vs))
        mask = causal_lower_right(T, L)
        base = {}
        for be in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                   SDPBackend.EFFICIENT_ATTENTION):
            fn = functools.partial(F.scaled_dot_product_attention, qs, kx, vx, attn_mask=mask)
            try:
                with sdpa_kernel([be]) if be else contextlib.nullcontext():
                    fn()
                    base[be.name if be else "DEFAULT"] = triton.testing.do_bench(
                        fn, warmup=25, rep=200, return_mode="median")
            except RuntimeError:
                pass
        best = min(base, key=base.get)
        ref = F.scaled_dot_product_attention(qs, kx, vx, attn_mask=mask)[0].transpose(0, 1)
        for name, kw in cfgs.items():
            fn = functools.partial(paged_prefill_attention, q, kc, vc, bt, cu, ctx, SCALE, T,
                                   k_new, v_new, **kw)
            try:
                err = ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < 1.5e-2, f"rel err {err}"
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            except Exception as e:  # noqa: BLE001
                rows.append(dict(prefix=prefix, T=T, cfg=name,
                                 failed=f"{type(e).__name__}: {e}"[:2000]))
                print(f"prefix {prefix} + T={T} {name:24s} FAILED {rows[-1]['failed'][:300]}",
                      flush=True)
                torch.cuda.synchronize()
                continue
            rows.append(dict(prefix=prefix, T=T, cfg=name, ms=ms, tflops=flops / ms / 1e9,
                             sdpa_best=best, sdpa_ms=base[best], sdpa_all_ms=base,
                             sdpa_tflops=flops / base[best] / 1e9, ratio=base[best] / ms,
                             rel_err=err))
            print(f"prefix {prefix} + T={T:5d} {name:24s} {ms:7.3f} ms "
                  f"{rows[-1]['tflops']:6.1f} TFLOP/s | SDPA {best} {base[best]:.3f} ms -> "
                  f"ratio {rows[-1]['ratio']:.2f}", flush=True)
        torch.cuda.empty_cache()
    return rows
