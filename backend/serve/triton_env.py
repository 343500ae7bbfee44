"""Find tritonserver and prepare a Python-backend directory for the running interpreter.

Two sources, in order:
1. `$TRITONSERVER` (binary) and `$TRITON_BACKEND_DIR` (its --backend-directory), as set by
   .gpu/bootstrap.sh or by a user with their own Triton build;
2. the `nvidia-pytriton` wheel, which ships tritonserver 2.51, the Python backend and one stub per
   Python version. We never write into site-packages: the backend directory is assembled under the
   cache (symlinks to libtriton_python.so and triton_python_backend_utils.py, a copy of the stub
   for *this* Python).

The stub runs the first `python3` on PATH and ignores PYTHONPATH, so `server_env()` puts the bin
directory of the running interpreter (the venv) first.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path


class SetupError(RuntimeError):
    """Something the server needs is missing; the message is one line meant for a user."""


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    lib_dir: Path | None  # bundled shared libraries (nvidia_pytriton.libs) or None


def _pytriton_root() -> Path | None:
    spec = importlib.util.find_spec("pytriton")  # no import: pytriton's __init__ is slow
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _stub_python_version() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def _prepare_backend_dir(src_backend: Path, stub: Path, dest: Path) -> Path:
    """Assemble `dest/python/` = the wheel's Python backend + the stub for this Python."""
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        link, target = py / name, src_backend / name
        if link.is_symlink() and link.resolve() == target.resolve():
            continue
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(target)
    dst_stub = py / "triton_python_backend_stub"
    if not dst_stub.exists() or dst_stub.stat().st_size != stub.stat().st_size:
        tmp = dst_stub.with_suffix(".tmp")
        shutil.copy2(stub, tmp)
        tmp.chmod(0o755)
        tmp.replace(dst_stub)  # atomic: two launchers may prepare the same cache at once
    return dest


def find_triton(cache_dir: Path) -> TritonInstall:
    """Locate tritonserver and a backend directory usable by the running Python."""
    env_bin = os.environ.get("TRITONSERVER")
    if env_bin:
        binary = Path(env_bin)
        if not os.access(binary, os.X_OK):
            raise SetupError(f"$TRITONSERVER={env_bin} is not an executable file")
        env_backends = os.environ.get("TRITON_BACKEND_DIR")
        backend_dir = Path(env_backends) if env_backends else binary.parent.parent / "backends"
        if not (backend_dir / "python" / "libtriton_python.so").exists():
            raise SetupError(f"no Python backend (python/libtriton_python.so) in {backend_dir}")
        libs = binary.parent.parent.parent.parent / "nvidia_pytriton.libs"
        return TritonInstall(binary, backend_dir, libs if libs.is_dir() else None)

    root = _pytriton_root()
    if root is None:
        raise SetupError(
            "tritonserver not found: install nvidia-pytriton (make setup) or set $TRITONSERVER"
        )
    server = root / "tritonserver"
    binary = server / "bin" / "tritonserver"
    stub = server / "python_backend_stubs" / _stub_python_version() / "triton_python_backend_stub"
    if not binary.exists():
        raise SetupError(f"nvidia-pytriton has no tritonserver binary at {binary}")
    if not stub.exists():
        raise SetupError(
            f"nvidia-pytriton has no Python backend stub for Python {_stub_python_version()}"
        )
    if not os.access(binary, os.X_OK):
        raise SetupError(f"{binary} is not executable (chmod +x it)")
    backend_dir = _prepare_backend_dir(server / "backends" / "python", stub,
                                       cache_dir / "triton_backends")
    libs = root.parent / "nvidia_pytriton.libs"
    return TritonInstall(binary, backend_dir, libs if libs.is_dir() else None)


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: venv bin first on PATH, bundled libs on LD_LIBRARY_PATH."""
    env = dict(os.environ if base is None else base)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    if install.lib_dir is not None:
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = str(install.lib_dir) + (os.pathsep + old if old else "")
    return env


def cuda_runtime_lib_dir() -> Path | None:
    """libcudart.so.12 from nvidia-cuda-runtime-cu12; perf_analyzer links against it."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        lib = Path(base) / "cuda_runtime" / "lib"
        if lib.is_dir():
            return lib
    return None


def perf_analyzer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    lib = cuda_runtime_lib_dir()
    if lib is not None:
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = str(lib) + (os.pathsep + old if old else "")
    return env
