"""What launching a CUDA graph costs the host, by its kernel count and PDL (the decode step's and a
speculative check's graphs hold ~700-1,200 kernels, PDL-launched; a step launches its check graph
after the read back that ends the step before, when the GPU is idle).

    python3 perf/kernels/diag_graph_launch.py --out $OUT/graph_launch.json

Per (kernels, PDL): a graph of that many tiny Triton kernels in a chain (each adds 1 to a buffer
after the one before); host ms of `replay()` after a synchronize (the launch the GPU waits for),
GPU ms between events around it, and the back-to-back replay time (launches overlapped).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl


@triton.jit
def _bump(x_ptr, N: tl.constexpr):
    pdl.trigger()
    pdl.wait()
    i = tl.arange(0, N)
    tl.store(x_ptr + i, tl.load(x_ptr + i) + 1.0)


def measure(n: int, use_pdl: bool, reps: int = 20) -> dict:
    x = torch.zeros(128, device="cuda")

    def chain():
        for _ in range(n):
            _bump[(1,)](x, N=128, launch_pdl=use_pdl)

    chain()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    host, gpu = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        g.replay()
        host.append(1e3 * (time.perf_counter() - t0))
        b.record()
        torch.cuda.synchronize()
        gpu.append(a.elapsed_time(b))
    b2b = triton.testing.do_bench(g.replay, warmup=5, rep=100, return_mode="median")
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return {"kernels": n, "pdl": use_pdl, "host_ms": med(host), "gpu_ms": med(gpu),
            "back_to_back_ms": b2b}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="graph_launch.json")
    ap.add_argument("--kernels", default="100,300,700,1200")
    args = ap.parse_args()
    rows = []
    for n in (int(v) for v in args.kernels.split(",")):
        for use_pdl in (False, True):
            rows.append(measure(n, use_pdl))
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
