"""The Triton kernel variants a serving step can meet are few, so that CUDA-graph capture and the
start-up warm-up (volundr.warmup) compile them all before the server is ready: a compile while
serving stalls every running request (~1 s a kernel on the GPU machine).

Triton's real compiler for sm_90 under test_kernels_compile's stand-in driver, in a subprocess
(this file as a script), with triton.knobs.runtime.jit_cache_hook recording each specialisation
and its constexprs by name. perf/diag_specializations.py runs whole steps' kernels this way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch


def probe() -> dict:
    from test_kernels_compile import _install_fake_driver  # (tests/ is on the path)

    _install_fake_driver()
    from triton import knobs

    from volundr.kernels.kda import engine as kda
    from volundr.kernels.quant import engine as quant
    from volundr.kernels.quant.fit import minmax_quant
    from volundr.kernels.quant.pack import pack_scale_zero, to_kernel_layout

    made: dict[str, list[dict]] = {}

    def hook(*, fn=None, compile=None, **_) -> bool:
        names = fn.jit_function.arg_names
        consts = {names[k[0]]: v for k, v in compile["constants"].items()
                  if isinstance(v, (int, bool)) and len(k) == 1}
        made.setdefault(fn.name, []).append(consts)
        return False

    knobs.runtime.jit_cache_hook = hook
    bf = torch.bfloat16
    out = {}
    # a 2048 x 2048 3-bit linear (the tensor-core paths' size floor) at 1-48 rows: a short
    # prefill, a step's logits rows, chunked calls of 16 rows and the rest
    qw, s, zr = minmax_quant(torch.randn(2048, 2048) / 32, 3, 128)
    layer = (*to_kernel_layout(qw, 3, 128), pack_scale_zero(s, zr))
    for m in range(1, 49):
        y = quant.quant_matmul(torch.randn(m, 2048, dtype=bf), *layer, 3, 128)
        assert y.shape == (m, 2048) and y.is_contiguous(), (m, y.shape)
    out["rows_R"] = sorted({c["R"] for c in made.get("gemv_i8_rows_kernel", [])})
    # KDA's short conv over 1-16 sequences of a prefill step
    C = 3 * 40 * 128
    for n in range(1, 17):
        lens = [(7 * i) % 23 + 1 for i in range(n)]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        kda.causal_conv(torch.randn(sum(lens), C, dtype=bf), torch.randn(C, 4, dtype=bf),
                        torch.zeros(n + 1, C, 3, dtype=bf), torch.arange(n), cu, "silu")
    conv = made.get("_conv_tok_kernel", [])
    out["conv_variants"], out["conv_BN"] = len(conv), sorted({c["BN"] for c in conv})
    return out


def test_serving_steps_meet_few_kernel_variants():
    """gemv_i8_rows (the 2-16-row matmuls) has its row count as a constexpr: outside CUDA-graph
    capture the engine rounds rows up to a power of two (kernels/quant/engine.eager_rows), the
    decode graphs' batch sizes, so every row count from 1 to 48 makes R in {1, 2, 4, 8, 16}
    only (before: each count its own compile for each weight shape). KDA's conv compiles once
    per power-of-two block of sequences, not again for each count's divisibility by 16."""
    p = subprocess.run([sys.executable, __file__, "probe"], capture_output=True, text=True,
                       timeout=900, cwd=Path(__file__).parent)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["rows_R"] == [1, 2, 4, 8, 16], r
    # (one variant per block of sequences it ran: few short sequences take _conv_seq_kernel)
    assert r["conv_BN"] == [4, 8, 16] and r["conv_variants"] == 3, r


if __name__ == "__main__":
    if sys.argv[1:] == ["probe"]:
        sys.path.insert(0, str(Path(__file__).parent))
        print(json.dumps(probe()))
