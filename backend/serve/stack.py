"""Start and stop tritonserver + the OpenAI proxy as child processes (launcher and tests).

`ServingStack(options).start()` fills a runtime copy of the model repository, starts
tritonserver, waits until every model is ready, starts the proxy, waits until it answers, and
`stop()` ends both (SIGINT to tritonserver for a graceful unload, then SIGKILL after a grace).
Errors a user can fix are `SetupError`s with a one-line message.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from volundr.serve.profiles import Profile
from volundr.serve.repo import write_runtime_repository
from volundr.serve.triton_env import SetupError, TritonInstall, find_triton, server_env


@dataclass(frozen=True)
class StackOptions:
    model_dir: Path
    profile: Profile
    cache_dir: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    proxy_port: int = 30000
    served_model_name: str = "volundr"
    startup_timeout_s: float = 600.0
    log_dir: Path | None = None  # default: the run directory
    proxy: bool = True  # also start the OpenAI proxy
    reasoning_split: bool = True  # proxy: <think>...</think> -> reasoning_content
    reasoning_opened: bool = False  # proxy: the chat template opens <think> in the prompt
    auto_session: bool = False  # proxy: chat turns without a session_id get one (their opening)
    # speculative decoding's drafter checkpoint (volundr.speculative); "mtp": the model's head
    draft_dir: Path | str | None = None
    num_speculative_tokens: int | None = None  # None: the engine's default
    spec_min_tokens: float | None = None  # None: the engine's default
    warmup: str = "auto"  # volundr_llm runs volundr.warmup before ready: auto (on a GPU), 1, 0


def llm_parameters(o: StackOptions) -> dict[str, str]:
    """The `parameters` of volundr_llm's config.pbtxt (read back by triton_llm.llm_kwargs)."""
    p = o.profile
    return {"model_dir": str(o.model_dir), "device": p.device,
            "max_num_seqs": str(p.max_num_seqs),
            "max_num_batched_tokens": str(p.max_num_batched_tokens),
            "max_model_len": str(p.max_model_len),
            "tensor_parallel_size": str(p.tensor_parallel_size),
            "decode_steps": str(p.decode_steps),
            "kv_cache_dtype": p.kv_cache_dtype,
            "session_gib": f"{p.session_gib:g}",
            "draft_model_dir": "" if o.draft_dir is None else str(o.draft_dir),
            "num_speculative_tokens": str(o.num_speculative_tokens or ""),
            "spec_min_tokens": "" if o.spec_min_tokens is None else f"{o.spec_min_tokens:g}",
            "max_inflight": str(p.max_inflight), "warmup": o.warmup,
            "gpu_gib": "" if p.gpu_gib is None else f"{p.gpu_gib:g}"}


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("", "0.0.0.0") else "0.0.0.0", port))
        except OSError:
            return True
    return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0") else host


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _supports_max_inflight(install: TritonInstall) -> bool:
    """Whether this tritonserver's config schema has ensemble max_inflight_requests."""
    candidates = list(install.lib_dir.glob("libtritonserver*.so*")) if install.lib_dir else []
    candidates += [install.binary.parent.parent / "lib" / "libtritonserver.so"]
    for lib in candidates:
        if lib.exists():
            return b"max_inflight_requests" in lib.read_bytes()
    return False


def _log_errors(log: Path, n: int = 12) -> str:
    if not log.exists():
        return ""
    lines = log.read_text(errors="replace").splitlines()
    picked = [ln for ln in lines if ln.startswith("E") or "rror" in ln][-n:]
    return "\n".join(picked or lines[-n:])


class ServingStack:
    def __init__(self, opts: StackOptions):
        self.opts = opts
        self.triton: subprocess.Popen | None = None
        self.proxy: subprocess.Popen | None = None
        self.run_dir: Path | None = None
        h = _client_host(opts.host)
        self.http_url = f"http://{h}:{opts.http_port}"
        self.grpc_url = f"{h}:{opts.grpc_port}"
        self.metrics_url = f"http://{h}:{opts.metrics_port}/metrics"
        self.proxy_url = f"http://{h}:{opts.proxy_port}"

    # ---- start -----------------------------------------------------------------------------
    def check_ports(self) -> None:
        o = self.opts
        ports = [("HTTP", o.http_port, "--http-port"), ("gRPC", o.grpc_port, "--grpc-port"),
                 ("metrics", o.metrics_port, "--metrics-port")]
        if o.proxy:
            ports.append(("proxy", o.proxy_port, "--proxy-port"))
        for what, port, flag in ports:
            if port_in_use(o.host, port):
                raise SetupError(f"port {port} ({what}) is already in use on {o.host}; "
                                 f"stop what holds it or pick another with {flag}")

    def start(self) -> ServingStack:
        o = self.opts
        self.check_ports()
        install = find_triton(o.cache_dir)
        runs = o.cache_dir / "runs"
        runs.mkdir(parents=True, exist_ok=True)
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"serve-{o.http_port}-", dir=runs))
        log_dir = o.log_dir or self.run_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.triton_log = log_dir / "tritonserver.log"
        self.proxy_log = log_dir / "proxy.log"
        p = o.profile
        llm = llm_parameters(o)
        tok = {"model_dir": str(o.model_dir)}
        repo = write_runtime_repository(
            self.run_dir / "model_repository",
            {"volundr_llm": llm, "preprocessing": tok, "postprocessing": tok},
            max_inflight=p.max_inflight if _supports_max_inflight(install) else None)
        shm = p.shm_mib * 2**20
        cmd = [str(install.binary), f"--model-repository={repo}",
               f"--backend-directory={install.backend_dir}",
               f"--backend-config=python,shm-default-byte-size={shm}",
               f"--backend-config=python,shm-growth-byte-size={shm}",
               f"--http-address={o.host}", f"--http-port={o.http_port}",
               f"--grpc-address={o.host}", f"--grpc-port={o.grpc_port}",
               f"--metrics-address={o.host}", f"--metrics-port={o.metrics_port}",
               "--allow-gpu-metrics=false", "--exit-timeout-secs=10",
               f"--log-verbose={os.environ.get('VOLUNDR_TRITON_LOG_VERBOSE', '0')}"]
        env = server_env(install)
        if p.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        with open(self.triton_log, "wb") as log:
            self.triton = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait(self.triton, f"{self.http_url}/v2/health/ready", "tritonserver",
                       self.triton_log)
            if o.proxy:
                self._start_proxy()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_proxy(self) -> None:
        o = self.opts
        cmd = [sys.executable, "-m", "volundr.clients.openai_proxy",
               "--host", o.host, "--port", str(o.proxy_port), "--triton-grpc", self.grpc_url,
               "--served-model-name", o.served_model_name,
               "--max-model-len", str(o.profile.max_model_len)]
        if not o.reasoning_split:
            cmd.append("--no-reasoning-split")
        if o.reasoning_opened:
            cmd.append("--reasoning-opened-in-prompt")
        if o.auto_session:
            cmd.append("--auto-session")
        with open(self.proxy_log, "wb") as log:
            self.proxy = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait(self.proxy, f"{self.proxy_url}/health", "the OpenAI proxy", self.proxy_log)

    def _wait(self, proc: subprocess.Popen, url: str, what: str, log: Path) -> None:
        deadline = time.monotonic() + self.opts.startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SetupError(f"{what} exited with code {proc.returncode} during startup "
                                 f"(log: {log}):\n{_log_errors(log)}")
            if _http_ok(url):
                return
            time.sleep(0.25)
        raise SetupError(f"{what} did not become ready within {self.opts.startup_timeout_s:g} s "
                         f"(log: {log})")

    # ---- run / stop ------------------------------------------------------------------------
    def poll(self) -> str | None:
        """Name of a child that has exited, or None while both run."""
        for name, proc in (("tritonserver", self.triton), ("the OpenAI proxy", self.proxy)):
            if proc is not None and proc.poll() is not None:
                return name
        return None

    def stop(self, grace_s: float = 15.0) -> None:
        for proc, sig in ((self.proxy, signal.SIGTERM), (self.triton, signal.SIGINT)):
            if proc is None or proc.poll() is not None:
                continue
            try:
                proc.send_signal(sig)
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the stubs go too
                proc.wait()
        if self.triton is not None:
            try:  # Python backend stubs left behind by a killed server
                os.killpg(self.triton.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.run_dir is not None:  # keep the logs unless they went elsewhere
            keep_logs = self.opts.log_dir is None
            shutil.rmtree(self.run_dir / "model_repository" if keep_logs else self.run_dir,
                          ignore_errors=True)

    def __enter__(self) -> ServingStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
