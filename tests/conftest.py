"""Shared fixtures.

`serving` starts the real stack once per session, exactly as `make serve` does (the
`volundr-serve` console script: tritonserver 2.51 from nvidia-pytriton with the model repository,
plus the OpenAI proxy) on free ports with the tiny checkpoint, and stops it with SIGTERM at the
end, checking that the launcher exits cleanly and leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

STARTUP_TIMEOUT_S = 300


@dataclass
class Serving:
    proc: subprocess.Popen
    model_dir: Path
    log_dir: Path
    http_port: int
    grpc_port: int
    metrics_port: int
    proxy_port: int
    output: list[str] = field(default_factory=list)

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def logs(self) -> str:
        parts = ["".join(self.output)]
        for name in ("tritonserver.log", "proxy.log"):
            p = self.log_dir / name
            if p.exists():
                parts.append(f"--- {name} (tail) ---\n" + "\n".join(
                    p.read_text(errors="replace").splitlines()[-40:]))
        return "\n".join(parts)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    from volundr.serve.launcher import default_cache_dir, tiny_checkpoint

    return tiny_checkpoint(default_cache_dir())


def _launcher() -> list[str]:
    script = Path(sys.executable).parent / "volundr-serve"
    return [str(script)] if script.exists() else [sys.executable, "-m", "volundr.serve.launcher"]


@pytest.fixture(scope="session")
def serving(tiny_dir: Path, tmp_path_factory) -> Serving:
    http, grpc, metrics, proxy = free_ports(4)
    log_dir = tmp_path_factory.mktemp("serve-logs")
    cmd = _launcher() + ["--model", str(tiny_dir), "--profile", "cpu",
                         "--http-port", str(http), "--grpc-port", str(grpc),
                         "--metrics-port", str(metrics), "--proxy-port", str(proxy),
                         "--log-dir", str(log_dir), "--startup-timeout", str(STARTUP_TIMEOUT_S),
                         "--drafter", "tiny",  # greedy requests decode speculatively
                         "--warmup", "1"]  # (on the CPU too: volundr.warmup's steps before ready)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    s = Serving(proc, tiny_dir, log_dir, http, grpc, metrics, proxy)
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            s.output.append(line)
            if line.startswith("volundr-serve: ready"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not ready.is_set():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"volundr-serve did not start:\n{s.logs()}")
        ready.wait(0.2)
    yield s
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"volundr-serve did not stop within 60 s of SIGTERM:\n{s.logs()}")
    assert rc == 0, f"volundr-serve exited with {rc} after SIGTERM:\n{s.logs()}"
    left = _processes_with(f"serve-{http}-".encode())  # tritonserver and its stubs
    assert not left, f"processes left after volundr-serve stopped: {left}"


def _processes_with(marker: bytes) -> list[str]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmd:
            text = cmd.replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{p.name}: {text[:120]}")
    return out
