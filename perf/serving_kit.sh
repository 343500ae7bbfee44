#!/usr/bin/env bash
# Builds .serve-kit/ (git-ignored): what perf/bench_serving.py needs on the GPU machine beyond
# .gpu/bootstrap.sh, which has no OpenAI proxy (FastAPI, uvicorn), no openai SDK and no
# perf_analyzer. Run it here once (it needs PyPI and the venv's tritonclient[all]); then carry
# ".serve-kit" with ".gpu" and, on the device, `source .serve-kit/env.sh` after the bootstrap.
#   kit.tar.xz  site/ (CPython 3.12 wheels at this venv's versions, no dependencies beyond the
#               image's), bin/perf_analyzer (the venv's, stripped), lib/ (libcudart.so.12 and
#               libb64, which it links and the image lacks)
#   env.sh      unpacks it to /tmp/serve-kit; PYTHONPATH += site, PERF_ANALYZER = a wrapper
#               that gives perf_analyzer its libraries (only it: torch keeps the image's CUDA)
# Size matters: the working tree + .gpu + this must stay under the device's 64 MiB (~7.5 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
KIT=.serve-kit
# the proxy's and the SDK's imports (checked against the image's package list, KINDS.md)
PKGS="fastapi starlette pydantic pydantic_core annotated-types annotated-doc typing-inspection
typing_extensions opentelemetry-api uvicorn h11 anyio idna sniffio openai jiter httpx2
httpcore2 truststore"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pins=()
for p in $PKGS; do
  v=$("$PY" -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
  [ -n "$v" ] || { echo "serving_kit: $p is not installed in $VENV" >&2; exit 1; }
  pins+=("$p==$v")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$tmp/wheels" "${pins[@]}"
"$PY" -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --target "$tmp/kit/site" "$tmp"/wheels/*.whl
find "$tmp/kit/site" -name RECORD -delete  # (pip metadata; nothing imports it)
mkdir -p "$tmp/kit/bin" "$tmp/kit/lib"
cp "$VENV/bin/perf_analyzer" "$tmp/kit/bin/perf_analyzer.bin"
strip "$tmp/kit/bin/perf_analyzer.bin"
cudart=$("$PY" -c 'from volundr.serve.triton_env import cuda_runtime_lib_dir as d; print(d())')
cp "$cudart/libcudart.so.12" "$tmp/kit/lib/"
cp "$(ldd "$VENV/bin/perf_analyzer" | awk '/libb64/{print $3}')" "$tmp/kit/lib/"
cat > "$tmp/kit/bin/perf_analyzer" <<'EOF'
#!/bin/sh
d=$(dirname "$0")
LD_LIBRARY_PATH="$d/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/perf_analyzer.bin" "$@"
EOF
chmod +x "$tmp/kit/bin/perf_analyzer"
mkdir -p "$KIT"
tar -C "$tmp/kit" -cf - . | xz -9e -T0 > "$KIT/kit.tar.xz"
cat > "$KIT/env.sh" <<'EOF'
# source after .gpu/bootstrap.sh (see perf/serving_kit.sh)
_k="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ -x /tmp/serve-kit/bin/perf_analyzer ] || { mkdir -p /tmp/serve-kit && tar -xJf "$_k/kit.tar.xz" -C /tmp/serve-kit; }
export PYTHONPATH="/tmp/serve-kit/site${PYTHONPATH:+:$PYTHONPATH}"
export PERF_ANALYZER=/tmp/serve-kit/bin/perf_analyzer
unset _k
EOF
ls -l "$KIT"
