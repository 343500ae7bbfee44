#!/usr/bin/env bash
# perf_analyzer (from tritonclient) needs Debian's libb64-0d. Install it when missing and we
# may (root, apt available); otherwise say what is missing, once.
if ! ldconfig -p 2>/dev/null | grep -q 'libb64.so.0d'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get install -y -q libb64-0d >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libb64-0d >/dev/null 2>&1; }) \
      || echo "note: could not install libb64-0d; perf_analyzer tests will be skipped" >&2
  else
    echo "note: libb64-0d is missing; perf_analyzer needs it (apt-get install libb64-0d)" >&2
  fi
fi
exit 0
