"""The end-to-end decode benchmark runs (tiny preset, CPU), so the GPU session's call can't fail
on a plain script error; its numbers here mean nothing and are not checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# the kernels' switches as suffixes
MIXED = "mixed@2+fold+gfold+rfold+chain+lrfold+late+early+e4:2/3:2+r1+w8+uncap+tcmin2048+s2"


def test_bench_decode_runs_on_the_tiny_preset(tmp_path):
    out = tmp_path / "decode.json"
    script = Path(__file__).parents[1] / "perf" / "bench_decode.py"
    r = subprocess.run([sys.executable, str(script), "--preset", "tiny", "--device", "cpu",
                        "--out", str(out), "--variants",
                        f"{MIXED},bf16,bf16+tp2,bf16+fp8kv,bf16+draftself+k2,bf16+mtp,bf16+nope",
                        "--tokens", "8", "--copy-gib", "0.05", "--prefill-lens", "40",
                        "--session-lens", "40", "--long-lens", "50"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [run["variant"] for run in res["runs"]] == [MIXED, "bf16", "bf16+tp2", "bf16+fp8kv",
                                                       "bf16+draftself+k2", "bf16+mtp",
                                                       "bf16+nope"]
    assert "unknown suffix +nope" in res["runs"].pop()["error"]  # recorded, the rest kept
    for run in res["runs"]:
        assert run["single"]["decode_tokens"] == 7 and run["batch16"]["decode_tokens"] == 16 * 3
        assert run["gpu_weight_GB"] > 0
        assert run["prefill"][0]["prompt_len"] == 40 and run["prefill"][0]["ttft_s"] > 0
        s = run["session"][0]  # turn 2 resumed: turn 1's prompt and 15 of its 16 tokens
        assert s["cached_tokens"] == 40 + 15, s  # (tp 2: every rank its shard)
        assert s["turn2_len"] == 40 + 16 + 64 and s["resumed_ttft_s"] > 0 and s["park_s"] > 0
        assert run["long"][0]["prompt_len"] == 50 and run["long"][0]["decode_tokens"] == 7
    mixed, bf16, tp2, fp8kv, spec, mtp = res["runs"]
    # speculative decoding with the model as its own drafter: the same greedy ids, guesses kept
    assert spec["single"]["ids_head"] == bf16["single"]["ids_head"]
    assert spec["batch16"]["ids_head"] == bf16["batch16"]["ids_head"]
    assert spec["spec_tokens"] > spec["spec_seqs"] > 0
    # the MTP head as the drafter (random: mostly wrong), the same greedy ids too
    assert mtp["single"]["ids_head"] == bf16["single"]["ids_head"] and mtp["spec_steps"] > 0
    assert (bf16["kv_cache_dtype"], fp8kv["kv_cache_dtype"]) == ("auto", "fp8")
    assert mixed["gpu_weight_GB"] < bf16["gpu_weight_GB"]  # quantized weights are smaller
    # two ranks (gloo here): rank 0 holds about half of the layers' weights
    assert tp2["tp"] == 2 and tp2["gpu_weight_GB"] < 0.6 * bf16["gpu_weight_GB"]


def test_bench_allreduce_runs_with_gloo(tmp_path):
    # the CUDA paths (NCCL and symmetric memory in graphs) need two GPUs; the script's frame,
    # its spawned ranks and the result check run here
    bench = Path(__file__).resolve().parents[1] / "perf" / "kernels" / "bench_allreduce.py"
    r = subprocess.run([sys.executable, str(bench), "--out", str(tmp_path), "--device", "cpu",
                        "--rows", "1,3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "allreduce.json").read_text())["rows"]
    assert [(x["rows"], x["ok"]) for x in rows] == [(1, True), (3, True)]


def test_bench_chain_smoke(tmp_path):
    """perf/kernels/bench_chain.py under the interpreter at tiny shapes: every variant's output
    checked against the launches' and timed (the CPU times mean nothing)."""
    import os

    bench = Path(__file__).resolve().parents[1] / "perf" / "kernels" / "bench_chain.py"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(bench), "--smoke", "--bits", "2", "--chains", "mlp",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "chain.json").read_text())["rows"]
    assert [x["variant"] for x in rows] == ["launches", "chain", "chain+pf1", "chain+pfall",
                                            "chain early=2", "chain early=0", "chain nocoop"]
    assert all(x["rel_err"] < 1e-2 and x["us"] > 0 for x in rows)


def test_bench_quant_config_syntax():
    """bench_quant's --tc-configs: "e:key=value" parts are the engine's config per bit width
    with those keys (maxnreg= empty: no cap), beside the positional form."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf" / "kernels"))
    import bench_quant

    cfgs = bench_quant.parse_cfgs("e:;e:tma=1,stages=3,waves=8.0;e:reps=1,maxnreg=;2,1,24,128")
    assert cfgs[:3] == [{"engine": True}, {"engine": True, "tma": True, "stages": 3,
                                           "waves": 8.0},
                        {"engine": True, "reps": 1, "maxnreg": None}]
    assert cfgs[3] == {"reps": 2, "num_warps": 1, "waves": 24.0, "maxnreg": 128}
    kw = bench_quant._tc_kwargs(cfgs[2], 4)
    assert kw["reps"] == 1 and "maxnreg" not in kw and kw["num_warps"] == 1
    assert bench_quant._tc_kwargs(cfgs[1], 3)["tma"] is True
