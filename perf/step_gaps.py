"""Where an engine step's wall time goes beside the GPU's work: a torch.profiler trace of a few
steps (CPU and CUDA activity), read back per step.

    from step_gaps import trace_steps
    summary = trace_steps(engine, run, "$OUT/gaps.txt")   # run(): drives engine.step

For each step (the `engine.step` record_function range on the host) it measures the wall time,
the GPU's busy time in it (the union of kernels, copies and memsets), the lead (host work
before the step's first GPU activity), the tail (after its last) and the largest idle gaps in
between with the kernels on either side; and the host ops with the most self time over the
steps. A graph replay's kernels show individually (CUPTI traces them).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

import torch

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _union(iv: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for a, b in sorted(iv):
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return busy


def step_summary(trace: dict, gaps: int = 5) -> list[dict]:
    """Per `engine.step` range of a chrome trace: wall_us, gpu_busy_us, lead_us, tail_us and
    the `gaps` largest idle gaps between GPU activities (us, the names before / after)."""
    ev = trace["traceEvents"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev  # (the host's range, not its
                   if e.get("name") == "engine.step" and e.get("ph") == "X"  # GPU twin)
                   and e.get("cat") == "user_annotation")
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in ev
                 if e.get("cat") in GPU_CATS and e.get("ph") == "X")
    out = []
    for s, t in steps:
        inside = [(max(a, s), min(b, t), n) for a, b, n in gpu if b > s and a < t]
        if not inside:
            out.append({"wall_us": t - s, "gpu_busy_us": 0.0})
            continue
        holes, end, prev = [], inside[0][1], inside[0][2]
        for a, b, n in inside[1:]:
            if a > end:
                holes.append((a - end, prev[:60], n[:60]))
            if b > end:
                end, prev = b, n
        holes.sort(reverse=True)
        out.append({"wall_us": round(t - s, 1),
                    "gpu_busy_us": round(_union([(a, b) for a, b, _ in inside]), 1),
                    "lead_us": round(inside[0][0] - s, 1),
                    "tail_us": round(t - max(b for _, b, _ in inside), 1),
                    "gpu_activities": len(inside),
                    "idle_between_us": round(sum(h[0] for h in holes), 1),
                    "gaps": [[round(h[0], 1), h[1], h[2]] for h in holes[:gaps]]})
    return out


def trace_steps(engine, run: Callable[[], object], path: str) -> dict:
    """Profiles `run()` (which calls engine.step), writes the per-step summary and the host ops
    by self time to `path` (text); returns the mean of the per-step numbers."""
    from torch.profiler import ProfilerActivity, profile, record_function

    step = engine.step

    def marked():
        with record_function("engine.step"):
            return step()

    engine.step = marked
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                     else [])
    try:
        with profile(activities=acts) as prof:
            run()
    finally:
        engine.step = step
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        with open(tmp) as f:
            steps = step_summary(json.load(f))
    finally:
        os.unlink(tmp)
    keys = ("wall_us", "gpu_busy_us", "lead_us", "tail_us", "idle_between_us", "gpu_activities")
    full = [s for s in steps if "lead_us" in s]
    mean = {k: round(sum(s[k] for s in full) / len(full), 1) for k in keys} if full else {}
    with open(path, "w") as f:
        f.write(f"mean over {len(full)} steps: {json.dumps(mean)}\n\n")
        for i, s in enumerate(steps):
            f.write(f"step {i}: {json.dumps(s)}\n")
        f.write("\nhost ops by self CPU time (all profiled steps)\n")
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    return mean
