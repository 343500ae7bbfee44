"""`volundr-serve`: tritonserver with the Volundr model repository + the OpenAI proxy.

    volundr-serve                          # the tiny checkpoint (built on first use), CPU
    volundr-serve --model DIR --profile 24gb
    volundr-serve --model owner/name --profile 48gb --gpu-gib 70

Ctrl-C or SIGTERM stops both. Problems a user can fix (a missing dependency, a port in use, no
checkpoint) end with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from volundr.clients.openai_reasoning import add_reasoning_args
from volundr.serve.profiles import PROFILES, profiles_table
from volundr.serve.triton_env import SetupError

REQUIRED = {"fastapi": "fastapi", "uvicorn": "uvicorn", "tritonclient": "tritonclient[all]",
            "torch": "torch", "tokenizers": "tokenizers", "jinja2": "jinja2"}
PROXY_ONLY = ("fastapi", "uvicorn")


def default_cache_dir() -> Path:
    """$VOLUNDR_CACHE, else .cache/ of this checkout (git-ignored), else ~/.cache/volundr."""
    if os.environ.get("VOLUNDR_CACHE"):
        return Path(os.environ["VOLUNDR_CACHE"])
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").exists() and os.access(repo, os.W_OK):
        return repo / ".cache"
    return Path.home() / ".cache" / "volundr"


def check_dependencies(proxy: bool = True) -> None:
    missing = [pkg for mod, pkg in REQUIRED.items()
               if (proxy or mod not in PROXY_ONLY) and importlib.util.find_spec(mod) is None]
    if missing:
        raise SetupError(f"missing Python packages: {', '.join(missing)} "
                         "(run `make setup`, or pip install -e '.[serve]')")


def _converter_stamp() -> str:
    """Hash of the converter's sources and data: the cached tiny checkpoint is rebuilt when
    they change (a checkout update must not serve a checkpoint of an older format)."""
    import hashlib

    import volundr.converter as conv

    h = hashlib.sha256()
    root = Path(conv.__file__).parent
    for f in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def tiny_checkpoint(cache_dir: Path, preset: str = "tiny") -> Path:
    """The default demo checkpoint (preset "draft-tiny": its drafter), built once per converter
    version (atomically: tests and `make serve` may race)."""
    out = cache_dir / preset
    stamp = _converter_stamp()
    if (out / ".stamp").exists() and (out / ".stamp").read_text() == stamp:
        return out
    print(f"volundr-serve: building the tiny checkpoint in {out}", flush=True)
    from volundr.converter.tiny import build_tiny

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{preset}-", dir=cache_dir))
    tmp.chmod(0o755)
    build_tiny(tmp, seed=0 if preset == "tiny" else 1, preset=preset)
    (tmp / ".stamp").write_text(stamp)
    old = cache_dir / f"{preset}-old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    try:
        tmp.rename(out)
    except OSError:  # someone else finished first
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return out


def resolve_model(spec: str | None, cache_dir: Path) -> Path:
    if spec is None:
        return tiny_checkpoint(cache_dir)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SetupError(f"{path} has no config.json: not a checkpoint directory")
        return path.resolve()
    from volundr.converter.loader import ModelNotFoundError, resolve_model_dir

    try:
        return resolve_model_dir(spec)
    except ModelNotFoundError as e:
        raise SetupError(str(e)) from None


def context_len(model_dir: Path, wanted: int) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    return min(wanted, int(cfg.get("max_position_embeddings", wanted)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="volundr-serve", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve Volundr: tritonserver (model repository: preprocessing -> "
                    "volundr_llm -> postprocessing, ensemble `volundr`) and an OpenAI-compatible "
                    "proxy.", epilog="profiles:\n" + profiles_table())
    ap.add_argument("--model", help="checkpoint directory or Hugging Face repo id "
                    "(default: the tiny checkpoint, built on first use in the cache)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    ap.add_argument("--gpu-gib", type=float, help="GPU memory budget, overrides the profile's")
    ap.add_argument("--max-num-seqs", type=int, help="overrides the profile's")
    ap.add_argument("--max-model-len", type=int, help="context length, overrides the profile's")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallel over GPUs cuda:0..N-1 of this machine (2 or 4)")
    ap.add_argument("--decode-steps", type=int, help="tokens per engine step when only "
                    "decodes run (fewer host round trips; speculative steps of greedy batches "
                    "with the MTP head), overrides the profile's")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "bf16", "fp8"),
                    help="attention KV cache: auto (the model dtype), bf16, or fp8 (e4m3: about "
                    "twice the KV tokens in the GPU budget); overrides the profile's")
    ap.add_argument("--session-gib", type=float,
                    help="host memory for parked sessions (requests with a session_id resume "
                    "from their state; 0: off), overrides the profile's")
    ap.add_argument("--auto-session", action="store_true",
                    help="OpenAI chat requests without a session_id resume their conversation's "
                    "previous turn (a session id derived from its opening messages)")
    ap.add_argument("--drafter", help="speculative decoding: a drafter checkpoint directory or "
                    "Hugging Face repo id (Volundr-Draft, the model's tokenizer; `tiny`: the "
                    "tiny checkpoint's, built on first use; `mtp`: the model's own MTP head, "
                    "1 guess a step by default); the model then checks its guesses several at "
                    "a time: "
                    "greedy output unchanged, sampled output from the model's distribution")
    ap.add_argument("--num-speculative-tokens", type=int,
                    help="guesses checked per step (with --drafter; the engine's default: "
                    "4 for a drafter, 1 for mtp)")
    ap.add_argument("--spec-min-tokens", type=float,
                    help="a sequence whose first 16 speculative steps made fewer tokens a step "
                    "than this decodes plainly after them (0: never; default 1.3, the engine's)")
    ap.add_argument("--warmup", choices=("auto", "1", "0"), default="auto",
                    help="before reporting ready, run a server's first kinds of engine steps on "
                    "made-up prompts so that their GPU kernels compile then, not during the "
                    "first requests (auto: on a GPU)")
    ap.add_argument("--host", default="127.0.0.1", help="address every server binds to")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--proxy-port", type=int, default=30000)
    ap.add_argument("--no-proxy", action="store_true",
                    help="serve Triton only (HTTP/gRPC), without the OpenAI proxy")
    ap.add_argument("--served-model-name", default="volundr",
                    help="the model name the OpenAI API answers to")
    add_reasoning_args(ap)
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="where the server logs go (default: a run directory in the cache)")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    return ap.parse_args(argv)


def build_options(args: argparse.Namespace):
    from volundr.serve.stack import StackOptions

    cache = args.cache_dir or default_cache_dir()
    model_dir = resolve_model(args.model, cache)
    p = PROFILES[args.profile]
    changes = {}
    if args.gpu_gib is not None:
        changes["gpu_gib"] = args.gpu_gib
    if args.max_num_seqs is not None:
        changes["max_num_seqs"] = args.max_num_seqs
    if args.decode_steps is not None:
        changes["decode_steps"] = args.decode_steps
    if args.kv_cache_dtype is not None:
        changes["kv_cache_dtype"] = args.kv_cache_dtype
    if args.session_gib is not None:
        changes["session_gib"] = args.session_gib
    changes["tensor_parallel_size"] = args.tp
    changes["max_model_len"] = context_len(model_dir, args.max_model_len or p.max_model_len)
    profile = dataclasses.replace(p, **changes)
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        raise SetupError("--num-speculative-tokens must be at least 1")
    if args.spec_min_tokens is not None and args.spec_min_tokens < 0:
        raise SetupError("--spec-min-tokens must be >= 0")
    draft_dir = None
    if args.drafter == "tiny" and not Path("tiny").is_dir():
        draft_dir = tiny_checkpoint(cache, "draft-tiny")
    elif args.drafter == "mtp":  # (passed on as the name: the engine uses the model's head)
        draft_dir = "mtp"
    elif args.drafter:
        draft_dir = resolve_model(args.drafter, cache)
    return StackOptions(draft_dir=draft_dir, num_speculative_tokens=args.num_speculative_tokens,
                        spec_min_tokens=args.spec_min_tokens,
                        model_dir=model_dir, profile=profile, cache_dir=cache, host=args.host,
                        http_port=args.http_port, grpc_port=args.grpc_port,
                        metrics_port=args.metrics_port, proxy_port=args.proxy_port,
                        served_model_name=args.served_model_name,
                        startup_timeout_s=args.startup_timeout, log_dir=args.log_dir,
                        proxy=not args.no_proxy, reasoning_split=not args.no_reasoning_split,
                        reasoning_opened=args.reasoning_opened_in_prompt,
                        auto_session=args.auto_session, warmup=args.warmup)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stopping = False

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # also when started with SIGINT ignored (nohup, &)
    stack = None
    try:
        check_dependencies(proxy=not args.no_proxy)
        from volundr.serve.stack import ServingStack

        opts = build_options(args)
        stack = ServingStack(opts)
        stack.check_ports()
        p = opts.profile
        print(f"volundr-serve: model {opts.model_dir}, profile {p.name} ({p.device}, "
              f"{p.max_num_seqs} sequences, context {p.max_model_len}); starting tritonserver...",
              flush=True)
        stack.start()
        openai = (f"  OpenAI API     {stack.proxy_url}/v1   (model \"{opts.served_model_name}\")\n"
                  if opts.proxy else "")
        print(f"""volundr-serve: ready
{openai}  Triton HTTP    {stack.http_url}    (ensemble "volundr"; also preprocessing, volundr_llm, \
postprocessing)
  Triton gRPC    {stack.grpc_url}
  metrics        {stack.metrics_url}
  logs           {stack.triton_log.parent}
Ctrl-C stops both.""", flush=True)
        while True:
            gone = stack.poll()
            if gone:
                print(f"volundr-serve: {gone} exited; stopping (logs: {stack.triton_log.parent})",
                      file=sys.stderr)
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        stopping = True
        print("\nvolundr-serve: stopping...", file=sys.stderr, flush=True)
        return 0
    except SetupError as e:
        print(f"volundr-serve: {e}", file=sys.stderr)
        return 2
    finally:
        # A second Ctrl-C or SIGTERM must not skip cleanup (orphaning tritonserver and the
        # proxy, which run in their own sessions): `make serve` relays a SIGTERM sent to its
        # process group to this process once more. stop() is bounded (grace, then SIGKILL).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if stack is not None:
            stack.stop()
        if stopping:
            print("volundr-serve: stopped", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
