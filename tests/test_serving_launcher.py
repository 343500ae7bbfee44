"""volundr-serve without starting a server: the model repository files, their filled runtime
copy, the backend directory, and one-line errors for what a user can fix; and one real start to
check that a second SIGTERM during shutdown leaves nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import _processes_with, free_ports
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from volundr.serve.profiles import PROFILES, profiles_table
from volundr.serve.repo import MODELS, model_parameters, source_repository, write_runtime_repository
from volundr.serve.triton_env import find_triton, server_env


def parse(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_repository_in_git_is_valid():
    repo = source_repository()
    cfgs = {m: parse(repo / m / "config.pbtxt") for m in MODELS}
    assert {m: c.name for m, c in cfgs.items()} == {m: m for m in MODELS}
    assert cfgs["volundr_llm"].model_transaction_policy.decoupled
    assert cfgs["preprocessing"].HasField("dynamic_batching")
    steps = [s.model_name for s in cfgs["volundr"].ensemble_scheduling.step]
    assert steps == ["preprocessing", "volundr_llm", "postprocessing"]
    for m in ("preprocessing", "volundr_llm", "postprocessing"):
        assert (repo / m / "1" / "model.py").exists()
        assert cfgs[m].parameters["model_dir"].string_value == ""  # filled at launch
    # Every ensemble input reaches a model input of the same name.
    llm_inputs = {i.name for i in cfgs["volundr_llm"].input}
    pre_inputs = {i.name for i in cfgs["preprocessing"].input}
    assert {i.name for i in cfgs["volundr"].input} <= llm_inputs | pre_inputs


def test_runtime_copy_is_filled(tmp_path):
    params = {"volundr_llm": {"model_dir": '/models/a "b"', "max_num_seqs": "3"},
              "preprocessing": {"model_dir": "/models/x"}}
    out = write_runtime_repository(tmp_path / "repo", params, max_inflight=32)
    llm = parse(out / "volundr_llm" / "config.pbtxt")
    assert llm.parameters["model_dir"].string_value == '/models/a "b"'
    assert llm.parameters["max_num_seqs"].string_value == "3"
    assert parse(out / "preprocessing" / "config.pbtxt").parameters["model_dir"].string_value \
        == "/models/x"
    assert "max_inflight_requests: 32" in (out / "volundr" / "config.pbtxt").read_text()
    assert model_parameters({"parameters": {"k": {"string_value": "v"}}}) == {"k": "v"}
    with pytest.raises(KeyError):
        write_runtime_repository(tmp_path / "r2", {"volundr_llm": {"no_such_key": "1"}})


def test_backend_dir_has_the_stub_for_this_python(tmp_path):
    if os.environ.get("TRITONSERVER"):
        pytest.skip("using $TRITONSERVER")
    inst = find_triton(tmp_path)
    py = inst.backend_dir / "python"
    assert (py / "libtriton_python.so").exists()
    assert os.access(py / "triton_python_backend_stub", os.X_OK)
    env = server_env(inst)
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)


def test_profiles():
    assert set(PROFILES) == {"cpu", "16gb", "24gb", "48gb"}
    assert PROFILES["cpu"].device == "cpu" and PROFILES["cpu"].gpu_gib is None
    # The product page's budgets and concurrency: 16 GiB / 1, 23 GiB / 4, 46 GiB / 16.
    assert [(PROFILES[p].gpu_gib, PROFILES[p].max_num_seqs) for p in ("16gb", "24gb", "48gb")] \
        == [(16.0, 1), (23.0, 4), (46.0, 16)]
    assert all(PROFILES[p].max_model_len == 262144 for p in ("16gb", "24gb", "48gb"))
    assert PROFILES["cpu"].decode_steps == 1
    assert all(PROFILES[p].decode_steps == 8 for p in ("16gb", "24gb", "48gb"))
    # the whole context inside 16 GiB needs the fp8 KV cache (the plan's pool: 292K tokens)
    assert [PROFILES[p].kv_cache_dtype for p in ("cpu", "16gb", "24gb", "48gb")] == \
        ["auto", "fp8", "auto", "auto"]
    assert profiles_table().count("\n") == len(PROFILES) + 1


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "volundr.serve.launcher", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def _one_line_error(p: subprocess.CompletedProcess, needle: str) -> None:
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and needle in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_port_in_use_is_one_line(tiny_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = _serve("--model", str(tiny_dir), "--http-port", str(port))
    _one_line_error(p, f"port {port} (HTTP) is already in use")


def test_missing_model_is_one_line():
    _one_line_error(_serve("--model", "/no/such/checkpoint"), "/no/such/checkpoint")


def test_missing_tritonserver_is_one_line(tiny_dir, tmp_path):
    p = _serve("--model", str(tiny_dir), "--http-port", "0", "--grpc-port", "0",
               "--metrics-port", "0", "--proxy-port", "0",
               env={"TRITONSERVER": str(tmp_path / "tritonserver")})
    _one_line_error(p, "TRITONSERVER")


def test_flags_override_the_profile(tiny_dir):
    from volundr.serve.launcher import build_options, parse_args

    o = build_options(parse_args(["--model", str(tiny_dir), "--decode-steps", "4",
                                  "--max-num-seqs", "3"]))
    assert (o.profile.decode_steps, o.profile.max_num_seqs) == (4, 3)
    assert build_options(parse_args(["--model", str(tiny_dir)])).profile.decode_steps == \
        PROFILES["cpu"].decode_steps


def test_kv_cache_dtype_and_session_flags_reach_the_engine(tiny_dir, tmp_path):
    """--kv-cache-dtype (and --session-gib) -> profile -> volundr_llm's filled config.pbtxt ->
    the LLM that its initialize() builds (the JSON model config Triton hands it) ->
    EngineConfig and caches."""
    from google.protobuf import json_format

    from volundr.engine import DRAFT_TOKENS, MTP_TOKENS, EngineConfig
    from volundr.llm import LLM
    from volundr.sampling_params import SamplingParams
    from volundr.serve.launcher import build_options, parse_args
    from volundr.serve.stack import llm_parameters
    from volundr.serve.triton_env import SetupError
    from volundr.serve.triton_llm import llm_kwargs

    def engine_kwargs(*flags: str) -> dict:
        o = build_options(parse_args(["--model", str(tiny_dir), *flags]))
        out = write_runtime_repository(tmp_path / f"repo{len(list(tmp_path.iterdir()))}",
                                       {"volundr_llm": llm_parameters(o)})
        cfg = json_format.MessageToDict(parse(out / "volundr_llm" / "config.pbtxt"),
                                        preserving_proto_field_name=True)
        return llm_kwargs(model_parameters(cfg))

    assert parse(source_repository() / "volundr_llm" / "config.pbtxt").parameters[
        "kv_cache_dtype"].string_value == "auto"
    assert engine_kwargs()["kv_cache_dtype"] == "auto"
    kw = engine_kwargs("--kv-cache-dtype", "fp8")
    assert kw["kv_cache_dtype"] == "fp8" and kw["device"] == "cpu"
    with LLM(tiny_dir, **kw) as llm:
        assert llm.engine.ecfg.kv_cache_dtype == "fp8"
        attn = llm.engine.runner.model.model.layers[llm.config.attention_layers[0]].self_attn
        assert attn.k_cache.dtype == attn.v_cache.dtype == torch.float8_e4m3fn
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-dtype", "fp16"])
    # --session-gib: host memory for parked sessions, the same way
    assert engine_kwargs()["session_gib"] == 4.0
    kw = engine_kwargs("--session-gib", "0.25")
    assert kw["session_gib"] == 0.25
    with LLM(tiny_dir, **kw) as llm:
        assert llm.engine.sessions.capacity_bytes == 2**28
    # --warmup: volundr_llm's `warmup` parameter, "auto" warming a GPU engine only
    from volundr.serve.triton_llm import wants_warmup

    def warm(*flags: str) -> str:
        o = build_options(parse_args(["--model", str(tiny_dir), *flags]))
        return llm_parameters(o)["warmup"]

    assert warm() == "auto" and warm("--warmup", "0") == "0"
    assert parse(source_repository() / "volundr_llm" / "config.pbtxt").parameters[
        "warmup"].string_value == "auto"
    assert [wants_warmup({"warmup": w}, d) for w, d in (
        ("auto", "cuda"), ("auto", "cuda:1"), ("auto", "cpu"), ("", "cpu"), ("1", "cpu"),
        ("0", "cuda"))] == [True, True, False, False, True, False]
    with pytest.raises(ValueError, match="warmup"):
        wants_warmup({"warmup": "yes"}, "cuda")
    # --auto-session goes to the proxy (StackOptions -> its --auto-session)
    assert build_options(parse_args(["--model", str(tiny_dir), "--auto-session"])).auto_session
    assert not build_options(parse_args(["--model", str(tiny_dir)])).auto_session
    # --drafter (tiny: the demo drafter) and --num-speculative-tokens: the engine's drafter
    assert engine_kwargs()["draft_model"] is None
    kw = engine_kwargs("--drafter", "tiny", "--num-speculative-tokens", "3")
    assert Path(kw["draft_model"]).name == "draft-tiny" and kw["num_speculative_tokens"] == 3
    with LLM(tiny_dir, **kw) as llm:
        assert llm.engine.drafter is not None and llm.engine.ecfg.num_speculative_tokens == 3
    kw = engine_kwargs("--drafter", "tiny")  # k unset: the engine's default
    assert kw["num_speculative_tokens"] is None
    with LLM(tiny_dir, **kw) as llm:
        assert llm.engine.ecfg.num_speculative_tokens == EngineConfig.num_speculative_tokens
        assert llm.engine.spec_k == DRAFT_TOKENS and llm.engine.check_len == DRAFT_TOKENS + 1
    kw = engine_kwargs("--drafter", "mtp")  # the model's MTP head: no drafter checkpoint
    assert kw["draft_model"] == "mtp"
    for k in (None, 3):  # (unset: MTP_TOKENS, the MTP head's default)
        extra = () if k is None else ("--num-speculative-tokens", str(k))
        with LLM(tiny_dir, **engine_kwargs("--drafter", "mtp", *extra)) as llm:
            assert llm.engine.mtp and llm.engine.drafter is None
            assert llm.engine.check_len == (k or MTP_TOKENS) + 1
            out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0,
                                                              ignore_eos=True))
            assert len(out[0]["token_ids"]) == 6 and llm.engine.stats()["spec_steps"] > 0
    # --spec-min-tokens: when a sequence stops speculating (unset: the engine's default)
    assert engine_kwargs("--drafter", "mtp")["spec_min_tokens"] is None
    kw = engine_kwargs("--drafter", "mtp", "--spec-min-tokens", "0")
    assert kw["spec_min_tokens"] == 0.0
    with LLM(tiny_dir, **kw) as llm:
        assert llm.engine.ecfg.spec_min_tokens == 0.0
    with pytest.raises(SetupError, match="spec-min-tokens"):
        build_options(parse_args(["--model", str(tiny_dir), "--spec-min-tokens", "-1"]))


@pytest.mark.server
def test_second_sigterm_during_shutdown_leaves_nothing_behind(tiny_dir, tmp_path):
    """`make serve` relays a SIGTERM sent to its process group to volundr-serve once more; that
    second signal used to kill the launcher mid-cleanup, orphaning tritonserver and the proxy
    (both run in their own sessions)."""
    http, grpc, metrics, proxy = free_ports(4)
    cmd = [sys.executable, "-m", "volundr.serve.launcher", "--model", str(tiny_dir),
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--proxy-port", str(proxy), "--log-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("volundr-serve: ready"):
                break
        else:
            pytest.fail(f"volundr-serve did not start (rc {proc.wait()})")
        proc.send_signal(signal.SIGTERM)
        for line in proc.stdout:
            if "stopping" in line:
                break
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # the relayed copy, while stop() runs
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = _processes_with(f"serve-{http}-".encode()) + \
        _processes_with(f"--port\0{proxy}".encode())
    for line in left:  # clean up before failing
        os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert rc == 0 and not left, (rc, left)
