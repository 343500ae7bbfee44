"""Group-wise asymmetric quantization with an error-minimising fit (no calibration data).

Per group of G inputs of one output row we want s, z (stored as bf16) and q in [0, 2^b - 1]
minimising ||w - (q - z) s||^2. Two stages, both vectorised over every group at once:
  1. range search: for shrink factors a (1.0 down to 0.6) take the min-max grid of [a*min,
     a*max], round s and z to bf16, assign q, keep each group's best a (clipping outliers pays
     at 2 and 3 bits);
  2. alternating least squares: with q fixed, (s, c = -z s) is a linear regression of w on q;
     re-round to bf16 and re-assign q; keep a group's new fit only where its error dropped.
Both stages only ever lower each group's squared error, so the result is never worse than
plain min-max rounding. Rows are processed in chunks to bound temporary memory.
"""

from __future__ import annotations

import torch

SHRINK = (1.0, 0.9, 0.8, 0.7, 0.6)


def _assign(w, s, z, qmax):
    """q = clamp(round(w / s + z)) and the per-group squared error; w [R, NG, G]."""
    q = torch.clamp(torch.round(w / s.unsqueeze(-1) + z.unsqueeze(-1)), 0, qmax)
    err = ((q - z.unsqueeze(-1)) * s.unsqueeze(-1) - w).square().sum(-1)
    return q, err


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def _fit_chunk(w: torch.Tensor, bits: int, iters: int, shrink):
    qmax = float((1 << bits) - 1)
    wmin = w.amin(-1)
    wmax = w.amax(-1)
    best = None
    for a in shrink:
        lo, hi = wmin * a, wmax * a
        s = _bf16(((hi - lo) / qmax).clamp_min(1e-10))
        z = _bf16(-lo / s)
        q, err = _assign(w, s, z, qmax)
        if best is None:
            best = [q, s, z, err]
            continue
        better = err < best[3]
        best[0] = torch.where(better.unsqueeze(-1), q, best[0])
        for j, t in ((1, s), (2, z), (3, err)):
            best[j] = torch.where(better, t, best[j])
    q, s, z, err = best
    for _ in range(iters):
        qm = q.mean(-1, keepdim=True)
        wm = w.mean(-1, keepdim=True)
        var = (q - qm).square().sum(-1)
        cov = ((q - qm) * (w - wm)).sum(-1)
        ok = var > 0
        s_new = torch.where(ok, cov / var.clamp_min(1e-12), s).clamp_min(1e-10)
        c = wm.squeeze(-1) - s_new * qm.squeeze(-1)
        s_new = _bf16(s_new)
        z_new = _bf16(-c / s_new)
        q_new, err_new = _assign(w, s_new, z_new, qmax)
        better = err_new < err
        q = torch.where(better.unsqueeze(-1), q_new, q)
        s, z, err = (torch.where(better, s_new, s), torch.where(better, z_new, z),
                     torch.where(better, err_new, err))
    return q, s, z


@torch.no_grad()
def fit_quant(w: torch.Tensor, bits: int, group_size: int, iters: int = 4, shrink=SHRINK,
              chunk_elems: int = 1 << 24):
    """W [N, K] -> (q uint8 [N, K], scales bf16 [N, K/G], zeros bf16 [N, K/G]) on W's device."""
    n, k = w.shape
    g = group_size
    if k % g:
        raise ValueError(f"group size {g} does not divide in_features {k}")
    q = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    s = torch.empty(n, k // g, dtype=torch.bfloat16, device=w.device)
    z = torch.empty_like(s)
    rows = max(1, chunk_elems // k)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        wc = w[r0:r1].to(torch.float32).view(r1 - r0, k // g, g)
        qc, sc, zc = _fit_chunk(wc, bits, iters, shrink)
        q[r0:r1] = qc.view(r1 - r0, k).to(torch.uint8)
        s[r0:r1] = sc.to(torch.bfloat16)
        z[r0:r1] = zc.to(torch.bfloat16)
    return q, s, z


@torch.no_grad()
def minmax_quant(w: torch.Tensor, bits: int, group_size: int, shrink: float = 1.0):
    """Plain (optionally clipped) min-max rounding: the fast path for random benchmark weights
    and the baseline the fit is tested against. Same outputs as fit_quant."""
    return fit_quant(w, bits, group_size, iters=0, shrink=(shrink,))


@torch.no_grad()
def output_error(w: torch.Tensor, w_hat: torch.Tensor, num_samples: int = 64,
                 seed: int = 0) -> float:
    """Relative Frobenius error ||(W - W_hat) X|| / ||W X|| for Gaussian X [K, num_samples]."""
    gen = torch.Generator(device=w.device)
    gen.manual_seed(seed)
    x = torch.randn(w.shape[1], num_samples, generator=gen, device=w.device)
    num = den = 0.0
    rows = max(1, (1 << 24) // w.shape[1])
    for r0 in range(0, w.shape[0], rows):
        wc = w[r0:r0 + rows].to(torch.float32)
        num += ((wc - w_hat[r0:r0 + rows].to(torch.float32)) @ x).square().sum().item()
        den += (wc @ x).square().sum().item()
    return (num / max(den, 1e-30)) ** 0.5
