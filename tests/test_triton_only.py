"""Triton alone (`volundr-serve --no-proxy`), on the CPU profile and, with CUDA, on a GPU profile
(bf16, CUDA graphs, the profile's decode_steps, the allocator cap; the GPU machine has no
FastAPI, hence no proxy): the tiny checkpoint through tritonclient gRPC, to volundr_llm directly
and through the ensemble, against the offline engine's greedy ids on the same device."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from triton_helpers import grpc_stream, texts

from volundr.clients.triton import VolundrTriton

PROMPT = "The smith Volundr forged"


def _start(tiny_dir: Path, log_dir: Path,
           profile: str) -> tuple[subprocess.Popen, int, list[str]]:
    from conftest import free_ports

    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "volundr.serve.launcher", "--model", str(tiny_dir),
           "--profile", profile, "--no-proxy", "--http-port", str(http), "--grpc-port",
           str(grpc), "--metrics-port", str(metrics), "--log-dir", str(log_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("volundr-serve: ready"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 300
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log = log_dir / "tritonserver.log"
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            pytest.fail("volundr-serve did not start:\n" + "".join(out) + tail)
    return proc, grpc, out


@pytest.mark.parametrize("device,profile", [
    ("cpu", "cpu"),
    pytest.param("cuda", "24gb", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                          reason="needs CUDA"))])
def test_triton_only_serving_matches_offline(tiny_dir, tmp_path, device, profile):
    from volundr.llm import LLM
    from volundr.sampling_params import SamplingParams
    from volundr.serve.profiles import PROFILES

    p = PROFILES[profile]
    with LLM(tiny_dir, device=device, max_num_seqs=p.max_num_seqs,
             decode_steps=p.decode_steps) as llm:
        ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False).ids
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        offline = llm.generate([ids], params)[0]["token_ids"]
        text = llm.tokenizer.decode(offline, skip_special_tokens=False)
    proc, port, out = _start(tiny_dir, tmp_path, profile)
    url = f"127.0.0.1:{port}"
    try:
        base = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
        streamed = grpc_stream(url, "volundr_llm",
                               VolundrTriton.inputs(input_ids=ids, stream=True, **base))
        got = [i for r in streamed for i in r.as_numpy("output_ids").reshape(-1).tolist()]
        assert got == offline and len(got) == 24
        ens = grpc_stream(url, "volundr", VolundrTriton.inputs(text_input=PROMPT, **base))
        assert texts(ens)[0] == text
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    assert rc == 0, "".join(out)
