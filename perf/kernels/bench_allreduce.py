"""Latency of the all-reduces a tensor-parallel decode step makes, on N GPUs of one host.

A Volundr-32B decode token makes 144 all-reduces of one [batch, 5120] bf16 row (after each
layer's o_proj and MLP down projection), one after the other, each waiting for the kernel
before it. This times such a chain inside one CUDA graph per rank, as the engine's decode graphs
run it: `chain` times (all-reduce, then a one-element-per-thread scale kernel that depends on it),
against the same chain without the all-reduces, so that

    us per all-reduce = (graph with them - graph without) / chain.

Paths: NCCL (torch.distributed.all_reduce, NVLink multicast off as in the engine) and, where
this torch has it, the one-shot all-reduce over symmetric memory (torch.ops.symm_mem: each rank
reads the peers' buffers over NVLink and sums; no multicast). Eager per-call times too.
Every path is checked: the result must equal the sum of the ranks' inputs.

    python3 perf/kernels/bench_allreduce.py --out $OUT [--tp 2] [--rows 1,16]
    python3 perf/kernels/bench_allreduce.py --out /tmp/x --device cpu   # gloo, eager (smoke)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 5120


def _timed(fn, reps: int, cuda: bool) -> float:
    """Median ms of fn() over reps calls."""
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def _graph(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up outside the capture (communicators, workspaces)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        fn()
    torch.cuda.synchronize()
    return g


def _paths(rank: int, tp: int, x: torch.Tensor) -> dict:
    """name -> in-place all-reduce of x."""
    paths = {"nccl" if x.is_cuda else "gloo": lambda: dist.all_reduce(x)}
    if x.is_cuda:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            group = dist.group.WORLD.group_name
            buf = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
            symm_mem.rendezvous(buf, group)

            def one_shot():
                buf.copy_(x)
                torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group, out=x)

            paths["symm_mem_one_shot"] = one_shot
        except Exception as e:  # not in this torch, or no peer access: recorded, not fatal
            paths["symm_mem_one_shot"] = repr(e)[:300]
    return paths


def _rank_main(rank: int, tp: int, port: int, args, q) -> None:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=tp, timeout=datetime.timedelta(seconds=120))
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    rows_out, graphs = [], []
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.empty(rows, HIDDEN, dtype=torch.bfloat16, device=dev)
        for name, op in _paths(rank, tp, x).items():
            r = dict(path=name, rows=rows, bytes=x.numel() * x.element_size())
            if isinstance(op, str):
                r["error"] = op
                rows_out.append(r)
                continue
            try:
                # correctness: rank r holds (r + 1) * v; the sum is tp (tp + 1) / 2 * v
                v = torch.arange(x.numel(), device=dev).view_as(x).remainder(7).to(x.dtype)
                x.copy_(v * (rank + 1))
                op()
                if cuda:
                    torch.cuda.synchronize()
                r["ok"] = bool(torch.equal(x.float(), v.float() * (tp * (tp + 1) / 2)))
                r["eager_us"] = 1e3 * _timed(op, 50, cuda)
                if cuda:
                    def chain(with_ar: bool, op=op, x=x):
                        for _ in range(args.chain):
                            if with_ar:
                                op()
                            x.mul_(0.5)  # a dependent kernel between, as in the decode step
                    g1, g0 = _graph(lambda: chain(True)), _graph(lambda: chain(False))
                    graphs += [g1, g0]
                    ms1, ms0 = _timed(g1.replay, args.reps, True), _timed(g0.replay, args.reps,
                                                                         True)
                    r.update(chain=args.chain, graph_ms=ms1, graph_ms_without=ms0,
                             graph_us_per_allreduce=1e3 * (ms1 - ms0) / args.chain)
            except Exception as e:
                r["error"] = repr(e)[:300]
            rows_out.append(r)
            if rank == 0:
                print(json.dumps(r), flush=True)
    for g in graphs:  # before the process group: NCCL's teardown waits for them
        g.reset()
    if rank == 0:
        q.put(rows_out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rows", default="1,16", help="rows of 5120 bf16 per all-reduce")
    ap.add_argument("--chain", type=int, default=144, help="all-reduces per graph")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    # NVLink multicast stays off (NCCL, symmetric memory, NVSHMEM), as on the GPU machines
    for var, off in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(var, off)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_rank_main, args=(r, args.tp, port, args, q))
             for r in range(args.tp)]
    for p in procs:
        p.start()
    rows = q.get(timeout=600)
    for p in procs:
        p.join(60)
    env = dict(torch=torch.__version__, tp=args.tp, device=args.device,
               gpu=torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "allreduce.json"), "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    bad = [r for r in rows if r.get("ok") is False]
    if bad:
        raise SystemExit(f"wrong all-reduce results: {bad}")


if __name__ == "__main__":
    main()
