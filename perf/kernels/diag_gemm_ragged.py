"""gemm_tc at ragged N on the GPU (the bug of 2026-12-03: 2/3-bit and 4-bit G = 64 wrong when
N % BN != 0, every output; fixed in session 6): which (bits, G, N, M, config) fail and which
outputs are wrong. Prints one line per case. Usage: python3 perf/kernels/diag_gemm_ragged.py"""

import sys

import torch

sys.path.insert(0, "tests")
from test_quant import _layer, _rel  # noqa: E402

from volundr.kernels.quant import gemm_tc as gt  # noqa: E402
from volundr.kernels.quant.naive import naive_quant_matmul  # noqa: E402

torch.manual_seed(0)
for bits, g in ((2, 128), (3, 128), (4, 128), (4, 64)):
    for n, k in ((200, 640), (192, 640), (320, 1024), (1000, 1152), (4032, 1024)):
        qa, qb, sz = _layer(n, k, bits, g, "cuda", 1)
        for m in (2, 9):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = naive_quant_matmul(x.float(), qa, qb, sz, bits, g, k)
            for kw in (dict(reps=1, splits=1), dict(reps=2, splits=1), dict(reps=2, splits=3)):
                bn = 32 * kw["reps"]
                out = torch.full((m, n), float("nan"), device="cuda")
                y = gt.gemm_tc(x, qa, qb, sz, bits, g, out=out, **kw)
                torch.cuda.synchronize()
                bad = ((y - ref).abs() > 1e-2 * ref.abs().max()) | ~torch.isfinite(y)
                cols = bad.any(0).nonzero().flatten().tolist()
                rows = bad.any(1).nonzero().flatten().tolist()
                err = _rel(torch.nan_to_num(y), ref)
                print(f"bits {bits} G {g} n {n} k {k} m {m} {kw} bn {bn} ragged {n % bn != 0} "
                      f"rel {err:.2e} bad_n {len(cols)} first {cols[:6]} last {cols[-3:]} "
                      f"tiles {sorted({c // bn for c in cols})[:8]} rows {rows}", flush=True)
