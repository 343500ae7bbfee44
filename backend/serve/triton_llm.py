"""Engine-thread glue of the `volundr_llm` Triton model, importable and testable without Triton.

One background thread owns the (not thread-safe) `volundr.LLM`: it drains a queue of commands
(add / abort / stats), runs `llm.step()`, polls each request's cancellation, and hands chunks to
each request's `Sink` (in Triton: a wrapper around its response_sender). `RequestStream` turns the
engine's new ids into chunks that end on clean UTF-8 boundaries (see detok.py) and never pass a
stop string.
"""

from __future__ import annotations

import gc
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from volundr.sampling_params import SamplingParams
from volundr.serve.clocks import GcClock, JitClock
from volundr.serve.detok import Utf8Boundary, text_delta
from volundr.serve.stop import find_stop, partial_stop_len
from volundr.session import DEFAULT_SESSION_GIB

log = logging.getLogger("volundr.serve")
PREFIX_MIN = 4  # ids of context before a chunk, enough for any decoder's look-behind
SLOW_STEP_S = 1.0  # an engine step longer than this is logged, with what it ran


def llm_kwargs(params: dict[str, str]) -> dict:
    """volundr.LLM's keyword arguments (all but the checkpoint) from volundr_llm's config.pbtxt
    `parameters` (filled by volundr-serve: stack.llm_parameters); empty values take defaults."""
    gpu_gib = params.get("gpu_gib") or None
    return dict(device=params.get("device") or None,
                max_num_seqs=int(params.get("max_num_seqs", 8)),
                max_num_batched_tokens=int(params.get("max_num_batched_tokens", 256)),
                max_model_len=int(params.get("max_model_len", 0)) or None,
                gpu_gib=float(gpu_gib) if gpu_gib else None,
                tensor_parallel_size=int(params.get("tensor_parallel_size") or 1),
                decode_steps=int(params.get("decode_steps") or 1),
                kv_cache_dtype=params.get("kv_cache_dtype") or "auto",
                session_gib=float(params.get("session_gib") or DEFAULT_SESSION_GIB),
                draft_model=params.get("draft_model_dir") or None,
                num_speculative_tokens=int(params.get("num_speculative_tokens") or 0) or None,
                spec_min_tokens=(float(params["spec_min_tokens"])
                                 if params.get("spec_min_tokens") else None))


def wants_warmup(params: dict[str, str], device: str) -> bool:
    """volundr_llm's `warmup` parameter: "auto" (the default) warms an engine on a GPU only,
    where Triton kernels compile; the CPU's ops are PyTorch's."""
    value = params.get("warmup") or "auto"
    if value not in ("auto", "1", "0"):
        raise ValueError(f"warmup must be auto, 1 or 0, not {value!r}")
    return value == "1" or (value == "auto" and not device.startswith("cpu"))


@dataclass(frozen=True)
class Chunk:
    output_ids: list[int]
    prefix_ids: list[int]
    trim_chars: int  # characters to cut from the end of this chunk's text (a stop string)
    finish_reason: str  # "" while streaming, then "stop" | "length" | "abort"
    num_input_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens resumed from the session's parked state
    # with logprobs asked: one (logprob, [(id, logprob)] alternatives) per id of output_ids
    logprobs: list | None = None


def logprobs_json(chunk: Chunk) -> str:
    """volundr_llm's `logprobs` output: JSON [[id, logprob, [[id, logprob], ...]], ...] for the
    chunk's output_ids, or "" where the request did not ask (top_logprobs)."""
    if chunk.logprobs is None:
        return ""
    return json.dumps([[t, lp, top] for t, (lp, top) in zip(chunk.output_ids, chunk.logprobs)])


class Sink(Protocol):
    def send(self, chunk: Chunk, final: bool) -> None: ...
    def error(self, message: str) -> None: ...
    def is_cancelled(self) -> bool: ...


class RequestStream:
    """Per request: buffers ids until they can be emitted (clean boundary, no partial stop)."""

    def __init__(self, boundary: Utf8Boundary, stops: Sequence[str], stream: bool,
                 num_input_tokens: int, min_tokens: int = 0):
        """min_tokens: stop strings are looked for once that many tokens are out (vLLM's
        rule)."""
        self.boundary, self.stops, self.stream = boundary, tuple(stops), stream
        self.min_tokens = min_tokens
        self.num_input_tokens = num_input_tokens
        self.ids: list[int] = []
        self.lps: list | None = None  # parallel to ids where the engine returns logprobs
        self.sent = 0  # ids[:sent] are emitted (or, when not streaming, accepted)
        self.starts = [0]  # clean boundaries at or before `sent`, for prefix_ids
        self.num_output_tokens = 0
        self.num_cached_tokens = 0

    def _prefix(self) -> list[int]:
        while len(self.starts) > 1 and self.starts[1] <= self.sent - PREFIX_MIN:
            self.starts.pop(0)
        return self.ids[self.starts[0]:self.sent]

    def push(self, new_ids: Sequence[int], finish_reason: str | None,
             num_output_tokens: int | None = None, num_cached_tokens: int = 0,
             new_logprobs: list | None = None) -> Chunk | None:
        """Add the engine's new ids (and their logprobs); returns a chunk to send, or None. A
        returned chunk with a finish_reason is the last one (a stop string sets reason "stop"
        itself)."""
        self.ids.extend(int(t) for t in new_ids)
        if new_logprobs is not None:
            self.lps = (self.lps or []) + list(new_logprobs)
        self.num_output_tokens = num_output_tokens or len(self.ids)
        self.num_cached_tokens = num_cached_tokens or self.num_cached_tokens
        pending = self.ids[self.sent:]
        prefix = self._prefix()
        trim, reason = 0, finish_reason
        clean = self.boundary.is_clean(self.ids, held=len(pending))
        if self.stops and pending and self.num_output_tokens >= self.min_tokens:
            text = text_delta(self.boundary.tokenizer, prefix, pending)
            at = find_stop(text, self.stops)
            if at >= 0:
                trim, reason = len(text) - at, "stop"
            elif reason is None and (not clean or partial_stop_len(text, self.stops)):
                return None
        elif reason is None and (not clean or not pending):
            return None
        if not self.stream and reason is None:
            self._advance()  # accepted; everything goes out in one response at the end
            return None
        lps = None if self.lps is None else self.lps[self.sent:]
        if not self.stream:
            prefix, pending, lps = [], self.ids, self.lps
        self._advance()
        return Chunk(pending, prefix, trim, reason or "", self.num_input_tokens,
                     self.num_output_tokens, self.num_cached_tokens, lps)

    def _advance(self) -> None:
        self.sent = len(self.ids)
        self.starts.append(self.sent)


@dataclass
class _Active:
    triton_id: str
    stream: RequestStream
    sink: Sink
    t_arrival: float = 0.0  # (monotonic: submit's)
    t_first: float | None = None  # its first token's


class EngineLoop:
    """Owns the LLM on one thread. `submit`, `abort` and `stats` may be called from any thread."""

    def __init__(self, llm, idle_wait_s: float = 0.5, max_in_flight: int | None = None,
                 metrics=None, slow_step_s: float = SLOW_STEP_S):
        """max_in_flight: backpressure; a request arriving while that many are running or
        waiting is refused at once ("server busy") instead of queueing without bound (Triton
        2.51 has no ensemble `max_inflight_requests`). metrics: volundr.serve.metrics's
        EngineMetrics (in Triton), told of each request's end and the engine's state. A step
        longer than slow_step_s is logged (a warning: what it ran, the collector's share), and so
        is any step that made Triton specialise kernels (how many, their seconds, names)."""
        self.llm = llm
        self.slow_step_s = slow_step_s
        self._gc = GcClock()
        self._jit = JitClock()
        self.metrics = metrics
        self._metrics_at = 0.0
        self.max_in_flight = max_in_flight
        self.boundary = Utf8Boundary(llm.tokenizer)
        self.idle_wait_s = idle_wait_s
        self._q: queue.Queue = queue.Queue()
        self._active: dict[str, _Active] = {}
        # Triton ids aborted before their request arrived (a client gone while its prompt was
        # still in preprocessing): such a request ends at once instead of generating unheard.
        self._tombstones: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="volundr-engine", daemon=True)

    def start(self) -> EngineLoop:
        gc.callbacks.append(self._gc)
        self._jit.install()
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._q.put(("wake",))
        self._thread.join(timeout)
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        self._jit.uninstall()

    # ---- commands (any thread) -------------------------------------------------------------
    def submit(self, triton_id: str, prompt_ids: list[int], params: SamplingParams,
               stops: Sequence[str], stream: bool, sink: Sink,
               session_id: str | None = None, priority: int = 0) -> None:
        try:  # a structured request's grammar compiles here, off the engine's thread
            grammar = self.llm.compile_grammar(params)
        except ValueError as e:
            sink.error(f"invalid request: {e}")
            return
        self._q.put(("add", triton_id, prompt_ids, params, tuple(stops), stream, sink,
                     session_id, priority, grammar, time.monotonic()))

    def abort(self, triton_id: str, reply: Callable[[dict], None]) -> None:
        """Abort every running request with this Triton request id; reply with the stats after."""
        self._q.put(("abort", triton_id, reply))

    def stats(self, reply: Callable[[dict], None]) -> None:
        self._q.put(("stats", reply))

    def close_session(self, session_id: str, reply: Callable[[dict], None]) -> None:
        """Drop the session's parked state; reply with the stats after (closed: 0 or 1)."""
        self._q.put(("close", session_id, reply))

    # ---- engine thread ---------------------------------------------------------------------
    def _stats(self, aborted: int | None = None) -> dict:
        s = dict(self.llm.stats())
        s["active_requests"] = len(self._active)
        if aborted is not None:
            s["aborted"] = aborted
        return s

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            (_, tid, prompt_ids, params, stops, stream, sink, session_id, priority, grammar,
             t_arrival) = cmd
            if tid and self._tombstones.pop(tid, None) is not None:
                rs = RequestStream(self.boundary, stops, stream, len(prompt_ids))
                self._send(_Active(tid, rs, sink), rs.push([], "abort"), final=True)
                return
            if self.max_in_flight and len(self._active) >= self.max_in_flight:
                sink.error(f"server busy: {len(self._active)} requests in flight (limit "
                           f"{self.max_in_flight}); retry later")
                return
            rid = uuid.uuid4().hex
            try:
                self.llm.add_request(prompt_ids, params, request_id=rid,
                                     session_id=session_id, priority=priority, grammar=grammar)
            except ValueError as e:
                msg = str(e)
                prefix = "prompt too long" if "context" in msg else "invalid request"
                sink.error(f"{prefix}: {msg}")
                return
            rs = RequestStream(self.boundary, stops, stream, len(prompt_ids), params.min_tokens)
            self._active[rid] = _Active(tid, rs, sink, t_arrival)
        elif kind == "abort":
            _, tid, reply = cmd
            hits = [rid for rid, a in self._active.items() if tid and a.triton_id == tid]
            for rid in hits:
                self._finish(rid, "abort")
            now = time.monotonic()
            self._tombstones = {t: at for t, at in self._tombstones.items() if now - at < 120}
            if tid and not hits:
                self._tombstones[tid] = now
            reply(self._stats(aborted=len(hits)))
        elif kind == "stats":
            cmd[1](self._stats())
        elif kind == "close":
            _, session_id, reply = cmd
            closed = self.llm.close_session(session_id)
            reply({**self._stats(), "closed": int(closed)})

    def _finish(self, rid: str, reason: str) -> None:
        """Ends a request early (abort or cancel): frees its blocks and slot, sends the end."""
        self.llm.abort(rid)
        a = self._active.pop(rid)
        chunk = a.stream.push([], reason)
        self._ended(a, reason)
        self._send(a, chunk, final=True)

    def _ended(self, a: _Active, reason: str) -> None:
        if self.metrics is not None:
            s = a.stream
            self._metric(self.metrics.finished, s.num_input_tokens, s.num_output_tokens,
                         s.num_cached_tokens, reason, a.t_arrival, a.t_first, time.monotonic())

    def _metric(self, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # (metrics must not fail requests)
            log.warning("volundr_llm: updating a metric failed: %s", e)

    def _send(self, a: _Active, chunk: Chunk | None, final: bool) -> None:
        if chunk is None:
            return
        try:
            a.sink.send(chunk, final)
        except Exception as e:  # a client gone away must not take the engine down
            log.warning("volundr_llm: sending a response failed: %s", e)

    def _step(self) -> None:
        for rid in [r for r, a in self._active.items() if a.sink.is_cancelled()]:
            self._finish(rid, "abort")
        if not self.llm.has_unfinished():
            return
        t, collected = time.perf_counter(), self._gc.total
        jit_n, jit_s = self._jit.count, self._jit.total
        outs = self.llm.step()
        seconds = time.perf_counter() - t
        if seconds > self.slow_step_s:
            self._slow_step(seconds, self._gc.total - collected, outs)
        if self._jit.count > jit_n:
            log.warning("volundr_llm: an engine step made Triton specialise %d kernels (%.2f s "
                        "of its %.2f s): %s", self._jit.count - jit_n, self._jit.total - jit_s,
                        seconds, ", ".join(self._jit.names[jit_n:]))
        for out in outs:
            a = self._active.get(out.request_id)
            if a is None:
                continue
            if out.new_token_ids and a.t_first is None:
                a.t_first = time.monotonic()
            chunk = a.stream.push(out.new_token_ids, out.finish_reason if out.finished else None,
                                  out.num_output_tokens, out.num_cached_tokens,
                                  out.new_logprobs)
            done = out.finished or (chunk is not None and chunk.finish_reason != "")
            if done and not out.finished:
                self.llm.abort(out.request_id)  # a stop string: free the sequence now
            if done:
                self._active.pop(out.request_id, None)
                self._ended(a, (chunk.finish_reason if chunk is not None else "")
                            or out.finish_reason or "stop")
            self._send(a, chunk, final=done)

    def _slow_step(self, seconds: float, collected: float, outs: list) -> None:
        first = [o for o in outs if o.new_token_ids and o.num_output_tokens == len(o.new_token_ids)]
        prompt = sum(a.stream.num_input_tokens for o in first
                     if (a := self._active.get(o.request_id)) is not None)
        log.warning("volundr_llm: an engine step took %.2f s: %d requests began generating "
                    "(%d prompt tokens), %d others got tokens, %d tokens out, %d requests in "
                    "flight; Python's cycle collector ran %.3f s of it", seconds, len(first),
                    prompt, sum(1 for o in outs if o.new_token_ids) - len(first),
                    sum(len(o.new_token_ids) for o in outs), len(self._active), collected)

    def _drain(self) -> None:
        """Handles the queued commands, waiting a little for one when the engine is idle."""
        timeout = self.idle_wait_s if not self.llm.has_unfinished() else None
        while True:
            try:
                cmd = self._q.get(timeout=timeout) if timeout else self._q.get_nowait()
            except queue.Empty:
                return
            self._handle(cmd)
            del cmd
            timeout = None

    def _observe(self) -> None:
        """The engine's gauges, about once a second."""
        now = time.monotonic()
        if self.metrics is not None and now - self._metrics_at >= 1.0:
            self._metrics_at = now
            self._metric(self.metrics.engine, self.llm.stats(), len(self._active))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._observe()
            self._drain()
            try:
                self._step()
            except Exception as e:  # keep serving: fail the running requests, not the server
                log.exception("volundr_llm: engine step failed")
                for rid in list(self._active):
                    a = self._active.pop(rid)
                    self.llm.abort(rid)
                    try:
                        a.sink.error(f"engine error: {e}")
                    except Exception:
                        pass
        for rid in list(self._active):
            self._finish(rid, "abort")
