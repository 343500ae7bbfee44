"""Plots of the recorded H200 runs (perf/results/): end-to-end decode per run, the batch-1
GEMV and 2-16 row GEMM comparisons (FMA / tl.dot tile path vs tensor-core path) and KDA
prefill per stage-1 implementation against fla. Needs matplotlib (not a project dependency).

    python perf/plot_results.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RUNS = {"run 1": "decode_run1.json", "run 3": "decode_run3.json", "run 4": "decode_run4.json",
        "run 5": "decode_run5.json", "run 6": "decode_run6.json",
        "run 6 PDL": "decode_run6_pdl.json", "run 8": "decode_run8.json",
        "run 9 PDL off": "decode_run9_base.json", "run 9 PDL": "decode_run9_pdl.json",
        "run 9 PDL 8 steps": "decode_run9_pdl_k8.json", "run 11": "decode_run11.json",
        "run 13 waves 48": "decode_run13.json", "run 13 L2 prefetch": "decode_run13_prefetch.json",
        "run 15": "decode_run15.json", "run 16": "decode_run16.json", "run 17": "decode_run17.json",
        "run 19": "decode_run19.json", "run 20": "decode_run20.json", "run 22": "decode_run22.json",
        "run 23": "decode_run23.json", "run 28": "decode_run28.json",
        "run 30": "decode_run30.json"}


def plot_decode(out: Path) -> None:
    labels, single, batch16, limit = [], [], [], None
    for run, name in RUNS.items():
        for r in json.loads((HERE / "results" / name).read_text())["runs"]:
            if not r["cuda_graphs"] or not r["variant"].startswith("mixed"):
                continue
            labels.append(f"{run}\n{r['variant']}")
            single.append(r["single"]["tok_per_s"])
            batch16.append(r["batch16"]["tok_per_s"] / 16)
            limit = r["byte_limit_tok_per_s"]
    fig, ax = plt.subplots(figsize=(max(10, 0.9 * len(labels)), 5))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], single, 0.4, label="1 stream, tok/s")
    ax.bar([i + 0.2 for i in x], batch16, 0.4, label="16 streams, tok/s per stream")
    ax.axhline(300, color="g", ls="--", label="goal 300 tok/s")
    ax.axhline(limit, color="r", ls=":", label=f"byte limit {limit:.0f} tok/s")
    ax.set_xticks(list(x), labels, fontsize=7, rotation=35, ha="right")
    ax.set_ylabel("tok/s")
    ax.set_title("Volundr-32B mixed ~3.2-bit greedy decode, H200, CUDA graphs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_gemv(out: Path) -> None:
    d = json.loads((HERE / "results" / "gemv_compare_h200.json").read_text())
    best: dict[tuple, dict[str, float]] = {}
    for r in d["rows"]:
        if r.get("us") is None:
            continue
        key = (f"{r['n']}x{r['k']}", r["bits"])
        cur = best.setdefault(key, {})
        cur[r["variant"]] = min(cur.get(r["variant"], 1e9), r["us"])
        cur["bytes"] = r["bytes"]
    keys = sorted(best, key=lambda k: (k[0], k[1]))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = range(len(keys))
    bw = d["copy_gbs"] * 1e9
    for off, v in ((-0.2, "fma"), (0.2, "tc")):
        ax.bar([i + off for i in x], [100 * best[k]["bytes"] / (best[k][v] * 1e-6) / bw
                                      for k in keys], 0.4, label=v)
    ax.axhline(80, color="g", ls="--", label="goal 80%")
    ax.set_xticks(list(x), [f"{s}\n{b}-bit" for s, b in keys], fontsize=7)
    ax.set_ylabel("% of HBM copy bandwidth")
    ax.set_title("Batch-1 mixed-bit GEMV (weights + scales + zeros), H200: FMA vs tensor cores")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_gemm16(out: Path) -> None:
    """Best time per (shape, bits, M) of the tile path and of gemm_tc, as the speed-up."""
    d = json.loads((HERE / "results" / "gemm16_compare_h200.json").read_text())
    best: dict[tuple, dict[str, float]] = {}
    for r in d["rows"]:
        if r.get("us") is not None:
            cur = best.setdefault((f"{r['n']}x{r['k']}", r["bits"], r["m"]), {})
            cur[r["variant"]] = min(cur.get(r["variant"], 1e9), r["us"])
    shapes = sorted({k[:2] for k in best})
    ms = sorted({k[2] for k in best})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    w = 0.8 / len(ms)
    for j, m in enumerate(ms):
        ax.bar([i + (j - (len(ms) - 1) / 2) * w for i in range(len(shapes))],
               [best[(s, b, m)]["tile"] / best[(s, b, m)]["tc"] for s, b in shapes], w,
               label=f"M = {m}")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks(range(len(shapes)), [f"{s}\n{b}-bit" for s, b in shapes], fontsize=7)
    ax.set_ylabel("speed-up of gemm_tc over the tl.dot tile")
    ax.set_title("Mixed-bit GEMM, 2 <= M <= 16, H200 (run 6)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_rows(out: Path) -> None:
    """gemv_i8_rows against gemm_tc (H100 runs 116-117): us per call by rows of x at three
    Volundr-32B shapes, and the decode graph's ms per step by batch."""
    d = json.loads((HERE / "results" / "gemv_rows_run116.json").read_text())
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (n, k, bits), color in (((17408, 5120, 4), "C0"), ((17408, 5120, 2), "C1"),
                                ((5120, 17408, 3), "C2")):
        rows = [r for r in d["rows"] if (r["n"], r["k"], r["bits"]) == (n, k, bits) and "us" in r]
        ms = sorted({r["rows"] for r in rows})
        base = [min(r["us"] for r in rows if r["rows"] == m and "engine" in r["variant"])
                for m in ms]
        ours = [min(r["us"] for r in rows if r["rows"] == m and r["variant"].startswith("rows"))
                for m in ms]
        label = f"{n}x{k} {bits}-bit"
        a1.plot(ms, base, "--o", color=color, label=f"{label}: gemv_i8 (1 row) / gemm_tc")
        a1.plot(ms, ours, "-s", color=color, label=f"{label}: gemv_i8_rows (best config)")
    a1.set_xlabel("rows of x")
    a1.set_ylabel("us per call")
    a1.set_xticks([1, 4, 5, 8, 16])
    a1.set_title("GEMV of M rows, H100 (run 116)")
    a1.set_ylim(0, 72)
    a1.legend(fontsize=6.5, loc="upper left")
    runs = json.loads((HERE / "results" / "decode_rows_run117.json").read_text())["runs"]
    for r, style in zip(runs, ("--o", "-s")):
        bs = [1, 2, 4, 8, 16]
        ms = [r["single" if b == 1 else f"batch{b}"]["graph_ms"] for b in bs]
        a2.plot(bs, ms, style, label="gemm_tc for 2-16 rows" if "i8rows" not in r["variant"]
                else "gemv_i8_rows for 2-16 rows")
    a2.set_xlabel("decode batch (sequences)")
    a2.set_ylabel("ms per decode step (CUDA graph)")
    a2.set_xticks([1, 2, 4, 8, 16])
    a2.set_ylim(bottom=0)
    a2.set_title("Volundr-32B mixed decode step, H100 (run 117)")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_kda_prefill(out: Path) -> None:
    """Prefill time per token of each stage-1 implementation and of fla's chunk_kda (run 58)."""
    rows = [json.loads(line) for line in
            (HERE / "results" / "kda_intra_run58.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind") == "intra_compare"]
    Ts = [r["T"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in ("fused", "sub", "split", "fla"):
        ax.plot(Ts, [r[f"{name}_ms"] * 1e3 / r["T"] for r in rows], "o-",
                label="fla chunk_kda" if name == "fla" else f"ours, stage 1 {name!r}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T (one sequence, H = 40, K = V = 128)")
    ax.set_ylabel("us per token (lower is better)")
    ax.set_title("KDA prefill (chunk_kda) on the H200, run 58")
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_prefill_attention(out: Path) -> None:
    """Prefill attention TFLOP/s: our kernels (paged gather, two-phase, two-phase with TMA
    descriptors for the new tokens) against SDPA's best backend (cuDNN), run 55."""
    d = json.loads((HERE / "results" / "attention_prefill_run55.json").read_text())
    rows = d["prefill"]
    Ts = sorted({r["T"] for r in rows})
    cfgs = {"paged (old default)": "m128_n128_w8_s2",
            "two-phase, gathered": "phased_m128_n128_w8_s3",
            "two-phase, TMA (default)": "desc_m128_n128_w8_s3"}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = range(len(Ts))
    width = 0.2
    for i, (label, cfg) in enumerate(cfgs.items()):
        ys = [next(r["tflops"] for r in rows if r["T"] == T and r["cfg"] == cfg) for T in Ts]
        ax.bar([x + (i - 1.5) * width for x in xs], ys, width, label=label)
    sdpa = [next(r["sdpa_tflops"] for r in rows if r["T"] == T) for T in Ts]
    ax.bar([x + 1.5 * width for x in xs], sdpa, width, label="SDPA best (cuDNN)", color="0.5")
    ax.set_xticks(list(xs), [f"{T // 1024}K" for T in Ts])
    ax.set_xlabel("new tokens T (one sequence, 40 q heads, 2 KV heads, d 128, causal)")
    ax.set_ylabel("TFLOP/s (higher is better)")
    ax.set_title("Prefill attention on the H200, run 55")
    ax.set_ylim(0, 760)
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_decode_attention_floor(out: Path) -> None:
    """Batch-1 decode attention (run 63, diag_decode_floor.py): our kernel, SDPA on contiguous
    K/V, and the load-only floor on the kernel's grid, as fractions of the D2D copy rate (the
    run's "1-hop" rows read L2-resident blocks at 4K / 32K: left out)."""
    d = json.loads((HERE / "results" / "decode_floor_run63.json").read_text())
    rows = [r for r in d["rows"] if r["batch"] == 1 and "us" in r]
    labels = {"kernel": "paged_decode_attention (split + merge)",
              "load": "load floor: same grid, K/V through the block table",
              "sdpa": "torch SDPA, contiguous K/V"}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for v, label in labels.items():
        pts = sorted((r["context"], r["frac_of_copy"]) for r in rows if r["variant"] == v)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ax.axhline(0.8, color="gray", ls=":", label="goal: 80% of copy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens), batch 1, 40 q / 2 KV heads, d 128, bf16")
    ax.set_ylabel("K+V bytes / time, fraction of D2D copy")
    ax.set_title("Batch-1 decode attention vs load-only floors, H200 run 63")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_speculative(out: Path) -> None:
    """Speculative decoding on the H100 (runs 122-124): single-stream tok/s of plain decode and
    of the MTP head's drafts (its block eager, in graphs, with every guess forced right), and
    the ms per step of speculative checks of 4 and 8 sequences with their 20 / 40-row matmuls
    on 64-row tiles or in 16-row gemv_i8_rows calls."""
    res = HERE / "results"
    ph = {v: json.loads((res / f"spec_phases_{v}_run122.json").read_text())
          for v in ("mtp", "mtpeager", "mtpright")}
    plain = 1e3 / ph["mtp"]["decode_graph_ms"]  # the same build's decode graph alone
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = ["plain decode\n(graph alone)", "MTP, block eager", "MTP, block in graphs",
             "MTP, every guess\nright (upper bound)"]
    vals = [plain] + [ph[v]["tok_per_s"] for v in ("mtpeager", "mtp", "mtpright")]
    bars = a1.bar(names, vals, color=["gray", "C1", "C0", "C2"])
    a1.bar_label(bars, fmt="%.0f")
    a1.set_ylabel("tok/s, one stream (phase timers on)")
    a1.set_title("Volundr-32B mixed, random weights: MTP drafts, H100 (run 122)")
    a1.tick_params(axis="x", labelsize=8)
    runs = json.loads((res / "decode_spec_chunk_run124.json").read_text())["runs"]
    x = [0, 1]
    for j, (r, label) in enumerate(zip(runs, ("64-row tiles", "16-row gemv_i8_rows calls"))):
        ms = [r[f"batch{b}"]["ms_per_step"] for b in (4, 8)]
        bars = a2.bar([i + 0.38 * j for i in x], ms, 0.38, label=label)
        a2.bar_label(bars, fmt="%.1f")
    a2.set_xticks([i + 0.19 for i in x], ["4 sequences (20 rows)", "8 sequences (40 rows)"])
    a2.set_ylabel("ms per speculative step (4 guesses, random drafter)")
    a2.set_title("Checks of 17-48 rows, H100 (run 124)")
    a2.set_ylim(0, 85)
    a2.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _mtp_depth(out: Path, ks: list[int], ms: list[float], rate: list[float],
               check: list[float], mtp: list[float], plain: float, title: str,
               rand: dict[int, float] | None = None) -> None:
    """Single-stream tok/s of the MTP head's k guesses a step with every guess accepted
    (`rate`, measured; ms per step `ms`), the tok/s a head would reach keeping each further
    guess with probability p (from the step times), the random weights' own guesses (`rand`:
    k -> tok/s), and each step's parts (check graph, k MTP block replays of `mtp` ms each, the
    rest)."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    a1.plot(ks, rate, "o-", color="C2", label="every guess accepted (measured)")
    for k, r in zip(ks, rate):
        a1.annotate(f"{r:.0f}", (k, r), textcoords="offset points", xytext=(-14, 6), fontsize=8)
    for a, c in ((0.9, "C0"), (0.8, "C1"), (0.7, "C3")):
        a1.plot(ks, [sum(a ** j for j in range(k + 1)) * 1e3 / m for k, m in zip(ks, ms)], "--",
                color=c, label=f"each further guess kept with p = {a} (from the step times)")
    if rand:
        a1.plot(list(rand), list(rand.values()), "x", color="k",
                label="random weights' own guesses (measured)")
    a1.axhline(plain, color="gray", lw=1, label=f"plain decode ({plain:.0f}, graph alone)")
    a1.set_xlabel("k, guesses a step (--num-speculative-tokens)")
    a1.set_ylabel("tok/s, one stream")
    a1.set_title(title)
    a1.legend(fontsize=7)
    rest = [m - c - k * q for m, c, k, q in zip(ms, check, ks, mtp)]
    a2.bar(ks, check, label="check graph (k + 1 rows)")
    a2.bar(ks, [k * q for k, q in zip(ks, mtp)], bottom=check, label="MTP block replays (k)")
    a2.bar(ks, rest, bottom=[c + k * q for c, k, q in zip(check, ks, mtp)],
           label="commit graph, host, read back")
    for k, m in zip(ks, ms):
        a2.text(k, m + 0.2, f"{m:.2f}", ha="center", fontsize=8)
    a2.set_xlabel("k")
    a2.set_ylabel("ms per step (one replay of the greedy step)")
    a2.set_title("A speculative step's parts")
    a2.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_mtp_depth(out: Path) -> None:
    """The MTP head's k guesses a step on the H100 (runs 130-132)."""
    res = HERE / "results"
    acc = {1: None, 2: "k2_run131", 3: "k3_run131", 4: "k4_run131", 6: "k6_run132"}
    runs = {k: json.loads((res / f"mtp_accept_{v}.json").read_text()) for k, v in acc.items()
            if v}
    r130 = json.loads((res / "mtp_accept_run130.json").read_text())["untimed"]
    ks = sorted(acc)
    ms = [r130["mixed@8+mtp+accept"]["ms_per_step"] if k == 1
          else runs[k]["untimed"]["ms_per_step"] for k in ks]
    rand = {k: json.loads((res / f"mtp_random_k{k}_run132.json").read_text()) for k in (1, 2)}
    check = [rand[1]["checks_graph_ms"]] + [runs[k]["checks_graph_ms"] for k in ks[1:]]
    mtp = [runs[k]["mtp_graphs_graph_ms"] for k in ks if k > 1]
    rate = [r130["mixed@8+mtp+accept"]["tok_per_s"] if k == 1
            else runs[k]["untimed"]["tok_per_s"] for k in ks]  # (prefill and first step in)
    _mtp_depth(out, ks, ms, rate, check, [mtp[0]] + mtp, 1e3 / rand[1]["decode_graph_ms"],
               "Volundr-32B mixed, MTP drafts, H100 (runs 130-132)",
               {k: rand[k]["untimed"]["tok_per_s"] for k in (1, 2)})


def plot_mtp_depth_h200(out: Path) -> None:
    """The same on the H200 with kda_rows (session 33, runs 139 and 141; no random-guess
    runs)."""
    res = HERE / "results"
    acc = {1: "k1_run139", 2: "k2_run139", 3: "k3_run139", 4: "k4_run141", 6: "k6_run141"}
    runs = {k: json.loads((res / f"mtp_accept_{v}.json").read_text()) for k, v in acc.items()}
    ks = sorted(runs)
    _mtp_depth(out, ks, [runs[k]["untimed"]["ms_per_step"] for k in ks],
               [runs[k]["untimed"]["tok_per_s"] for k in ks],
               [runs[k]["checks_graph_ms"] for k in ks],
               [runs[k]["mtp_graphs_graph_ms"] for k in ks],
               1e3 / runs[1]["decode_graph_ms"],
               "Volundr-32B mixed, MTP drafts, H200 (runs 139, 141)")

def plot_spec_glue(out: Path) -> None:
    """A perfect MTP head's single stream on the H100 (session 35, run 150): one speculative
    step a read back or up to 8 (decode_steps), the work between the graphs as PyTorch ops or
    the three Triton kernels, against the graphs' own bound ((k + 1) tokens per the check,
    commit and k MTP replays)."""
    res = HERE / "results"
    cases = [("1", "torch", "1 step / read back,\nPyTorch glue"),
             ("1", "triton", "1 step,\nTriton glue"), ("8", "torch", "8 steps,\nPyTorch glue"),
             ("8", "triton", "8 steps,\nTriton glue")]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.2
    for x, k in enumerate((2, 3)):
        runs = [json.loads((res / f"spec_glue_{g}_mixed_{s}_mtp_accept_k{k}_run150.json")
                           .read_text()) for s, g, _ in cases]
        for i, r in enumerate(runs):
            v = r["untimed"]["tok_per_s"]
            ax.bar(x + (i - 1.5) * width, v, width, color=f"C{i}",
                   label=cases[i][2] if x == 0 else None)
            ax.text(x + (i - 1.5) * width, v + 3, f"{v:.0f}", ha="center", fontsize=8)
        r = runs[-1]
        graphs = (r["checks_graph_ms"] + r["checks_commit_graph_ms"]
                  + k * r["mtp_graphs_graph_ms"])
        bound = (k + 1) * 1e3 / graphs
        ax.hlines(bound, x - 2 * width, x + 2 * width, colors="k", linestyles="dashed",
                  label="graphs alone" if x == 0 else None)
    ax.set_xticks([0, 1], ["k = 2", "k = 3"])
    ax.set_ylabel("tok/s, one stream (every guess kept)")
    ax.set_ylim(250, 440)
    ax.set_title("Volundr-32B mixed, MTP head, H100 (run 150)")
    ax.legend(fontsize=8, loc="upper left", ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    plot_spec_glue(HERE / "spec_steps_h100.png")
    plot_mtp_depth(HERE / "mtp_depth_h100.png")
    plot_mtp_depth_h200(HERE / "mtp_depth_h200.png")
    plot_speculative(HERE / "speculative_h100.png")
    plot_rows(HERE / "gemv_rows_h100.png")
    plot_decode_attention_floor(HERE / "decode_attention_floor_h200.png")
    plot_prefill_attention(HERE / "prefill_attention_h200.png")
    plot_kda_prefill(HERE / "kda_prefill_h200.png")
    plot_decode(HERE / "decode_h200.png")
    plot_gemv(HERE / "gemv_tc_h200.png")
    plot_gemm16(HERE / "gemm16_tc_h200.png")
