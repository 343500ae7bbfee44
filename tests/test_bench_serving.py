"""perf/bench_serving.py end to end on the CPU, so that the GPU session's one call can't fail on a
script error: a random tiny volundr-mixed checkpoint written in shards (perf/random_checkpoint.py)
and served by the real stack, perf_analyzer and the OpenAI SDK at tiny lengths. Its numbers mean
nothing here; checked: they are there, every reply had the length asked for, and the servers are
gone afterwards, also when the run is stopped with SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import _processes_with
from tokenizers import Tokenizer

pytestmark = pytest.mark.server
PERF = Path(__file__).resolve().parents[1] / "perf"
sys.path.insert(0, str(PERF))  # (random_checkpoint, imported where it is used)
TINY = ["--prompt-tokens", "8", "--output-tokens", "8", "--concurrency", "2",
        "--single-requests", "2", "--rounds", "1", "--measure-timeout", "120"]


def bench(args: list[str], out: Path, stop_after: str | None = None) -> tuple[int, str, dict]:
    """Runs the script (SIGTERM once a stdout line starts with `stop_after`): (rc, stdout, JSON).
    On a timeout it gets SIGTERM too, so that it stops its servers before the test fails."""
    p = subprocess.Popen([sys.executable, str(PERF / "bench_serving.py"), *args, "--out",
                          str(out), "--log-dir", str(out.parent / "logs")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if stop_after and line.startswith(stop_after):
                p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=240)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        p.wait(60)
        pytest.fail("bench_serving.py timed out:\n" + "".join(lines)[-3000:])
    return rc, "".join(lines), json.loads(out.read_text())


def servers_left(res: dict) -> list[str]:
    """tritonserver and its stubs (the run directory's name), the proxy (its port)."""
    s = res["server"]
    return _processes_with(f"serve-{s['http_port']}-".encode()) + \
        _processes_with(f"--port\0{s['proxy_port']}\0".encode())


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, Path, str]:
    d = tmp_path_factory.mktemp("bench-serving")
    ckpt = d / "random-tiny"
    rc, stdout, res = bench(["--random-preset", "tiny", "--checkpoint-dir", str(ckpt),
                             "--shard-gib", "0.0003", *TINY], d / "serving.json")
    assert rc == 0, stdout[-4000:]
    return res, ckpt, stdout


def test_measures_fixed_lengths_and_stops_the_servers(run):
    res, _, stdout = run
    assert res["errors"] == [] and "serving benchmark: " in stdout
    check = res["checks"]["triton"]
    assert (check["prompt_tokens"], check["output_tokens"], check["finish_reason"]) == \
        (8, 8, "length") and check["responses"] > 1
    assert set(res["perf_analyzer"]) == {"c1", "c2", "c2_again"}  # (N again, at the end)
    assert set(res["openai"]) == {"chat_s1", "chat_s2", "completions_s1", "completions_s2"}
    for name, m in [*res["perf_analyzer"].items(), *res["openai"].items()]:
        assert m["requests"] == 2 and m["output_tokens_each"] == [8], (name, m)
        assert m["requests_per_s"] > 0 and m["output_tok_per_s"] > 0, (name, m)
        for k in ("ttft_ms", "itl_ms", "e2e_ms", "decode_tok_per_s_per_stream"):
            assert m[k]["p50"] > 0, (name, k, m)
        sent, ttft, e2e = zip(*m["timeline"])  # per request, in send order
        assert len(sent) == 2 and sent[0] == 0 and list(sent) == sorted(sent), (name, m)
        assert all(0 < a <= b for a, b in zip(ttft, e2e)), (name, m)
    for c in ("c1", "c2"):
        pa = res["perf_analyzer"][c]
        assert pa["prompt_tokens_each"] == [8] and pa["pa_infer_per_s"] > 0
        assert pa["pa_latency_ms"]["p50"] > 0
        # the server's metrics over the load: each model saw its 2 requests; the engine's TTFT
        # (from the arrival at volundr_llm) lies inside the client's
        sm = pa["server_metrics"]
        assert {m: sm[m]["requests"] for m in sm} == {
            "volundr": 2, "preprocessing": 2, "volundr_llm": 2, "postprocessing": sm[
                "postprocessing"]["requests"]}, sm
        assert sm["postprocessing"]["requests"] >= 2 and sm["volundr"]["request_ms"] > 0
        assert 0 < sm["volundr_llm"]["engine_ttft_ms"] <= pa["ttft_ms"]["mean"], (sm, pa)
        assert sm["volundr_llm"]["engine_e2e_ms"] <= pa["e2e_ms"]["mean"], (sm, pa)
    # the completions prompt is the text alone; chat wraps it in the template
    assert res["openai"]["completions_s1"]["prompt_tokens_each"] == [8]
    assert res["openai"]["chat_s1"]["prompt_tokens_each"][0] > 8
    assert res["server"]["start_s"] > 0 and res["server"]["pids"]
    assert not servers_left(res)


def test_random_checkpoint_is_sharded_and_reused(run, capsys):
    res, ckpt, _ = run
    from random_checkpoint import write_random_checkpoint

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == res["checkpoint"]["random"]["shards"] > 1
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == shards
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["method"] == "volundr-mixed"
    assert any(n.endswith(".qweight") for n in index["weight_map"])
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    assert write_random_checkpoint("tiny", ckpt) == ckpt  # complete: reused as it is
    assert "reusing" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before


def test_padded_tokenizer_encodes_alike_and_decodes_every_id():
    from random_checkpoint import padded_tokenizer_json

    from volundr.converter.tokenizer import load_tokenizer

    base, padded = load_tokenizer(), Tokenizer.from_str(padded_tokenizer_json(8192))
    assert padded.get_vocab_size() == 8192 > base.get_vocab_size()
    text = "The smith Volundr forged x4096 rings<|im_end|> x8191x5000 \u00e9\u6587"
    assert padded.encode(text).ids == base.encode(text).ids
    assert padded.decode([5000, 8191]) == " x5000 x8191"


def test_sigterm_mid_run_stops_the_servers(run, tmp_path):
    _, ckpt, _ = run
    args = ["--model", str(ckpt), *TINY, "--output-tokens", "600"]  # (long: still running)
    rc, stdout, res = bench(args, tmp_path / "serving.json",
                            stop_after="bench_serving: perf_analyzer c1")
    assert rc == 1 and "interrupted" in res["errors"], stdout[-3000:]
    assert res["server"]["stop_s"] > 0 and not servers_left(res)
