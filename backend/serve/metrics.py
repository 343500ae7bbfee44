"""volundr_llm's engine metrics, served by tritonserver beside its own (Prometheus text at
http://HOST:METRICS_PORT/metrics), named as Triton's vLLM backend names its engine's, with the
prefix `volundr:` and labels model / version:

  counters    volundr:prompt_tokens_total, volundr:generation_tokens_total,
              volundr:cached_prompt_tokens_total (prompt tokens a parked session let skip),
              volundr:request_success_total{finish_reason} (stop / length / abort / ...),
              volundr:spec_tokens_total and volundr:spec_sequence_steps_total (tokens made by
              speculative steps and the sequences those steps ran: their ratio is the tokens a
              sequence gets per speculative step)
  gauges      volundr:num_requests_running, volundr:num_requests_waiting,
              volundr:kv_cache_usage_perc (the fraction of KV blocks in use),
              volundr:num_requests_active (requests of the Triton model not yet answered)
  histograms  volundr:time_to_first_token_seconds, volundr:time_per_output_token_seconds,
              volundr:e2e_request_latency_seconds (from the request's arrival at volundr_llm)

`family` is triton_python_backend_utils.MetricFamily (the stub's custom-metrics API). The
engine thread calls `finished` as each request ends and `engine` every second or so.
"""

from __future__ import annotations

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0]
TPOT_BUCKETS = [0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0,
               600.0]


class EngineMetrics:
    def __init__(self, family, labels: dict[str, str]):
        self.family, self.labels = family, dict(labels)
        self.families: dict[str, object] = {}  # (kept alive while their metrics are)
        c, g, h = family.COUNTER, family.GAUGE, family.HISTOGRAM
        self.prompt = self._metric("prompt_tokens_total", "Prompt tokens of finished requests", c)
        self.generated = self._metric("generation_tokens_total", "Tokens generated", c)
        self.cached = self._metric("cached_prompt_tokens_total",
                                   "Prompt tokens resumed from a parked session", c)
        self.spec_tokens = self._metric("spec_tokens_total",
                                        "Tokens made by speculative steps", c)
        self.spec_seqs = self._metric("spec_sequence_steps_total",
                                      "Sequences run by speculative steps", c)
        self.running = self._metric("num_requests_running", "Sequences running", g)
        self.waiting = self._metric("num_requests_waiting", "Sequences waiting", g)
        self.kv = self._metric("kv_cache_usage_perc", "Fraction of KV cache blocks in use", g)
        self.active = self._metric("num_requests_active", "Requests not yet answered", g)
        self.ttft = self._metric("time_to_first_token_seconds", "Time to first token", h,
                                 TTFT_BUCKETS)
        self.tpot = self._metric("time_per_output_token_seconds",
                                 "Time per output token after the first", h, TPOT_BUCKETS)
        self.e2e = self._metric("e2e_request_latency_seconds", "Request latency", h,
                                E2E_BUCKETS)
        self.success: dict[str, object] = {}
        self.last_spec = (0, 0)

    def _metric(self, name: str, description: str, kind, buckets=None, **labels):
        name = "volundr:" + name
        fam = self.families.get(name)
        if fam is None:
            fam = self.families[name] = self.family(name=name, description=description,
                                                   kind=kind)
        labels = {**self.labels, **labels}
        return fam.Metric(labels=labels) if buckets is None else fam.Metric(labels=labels,
                                                                          buckets=buckets)

    def finished(self, num_prompt: int, num_output: int, num_cached: int, reason: str,
                 t_arrival: float, t_first: float | None, t_end: float) -> None:
        """A request's end (monotonic times: its arrival, its first token or None, now)."""
        self.prompt.increment(num_prompt)
        self.generated.increment(num_output)
        self.cached.increment(num_cached)
        m = self.success.get(reason)
        if m is None:
            m = self.success[reason] = self._metric(
                "request_success_total", "Finished requests by finish reason",
                self.family.COUNTER, finish_reason=reason)
        m.increment(1)
        self.e2e.observe(t_end - t_arrival)
        if t_first is not None:
            self.ttft.observe(t_first - t_arrival)
            if num_output > 1:
                self.tpot.observe((t_end - t_first) / (num_output - 1))

    def engine(self, stats: dict, active: int) -> None:
        """The gauges and the speculative counters from the engine's stats."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        total = stats["num_blocks_total"]
        self.kv.set((total - stats["num_blocks_free"]) / total if total else 0.0)
        self.active.set(active)
        tok, seqs = stats.get("spec_tokens", 0), stats.get("spec_seqs", 0)
        if tok > self.last_spec[0]:
            self.spec_tokens.increment(tok - self.last_spec[0])
        if seqs > self.last_spec[1]:
            self.spec_seqs.increment(seqs - self.last_spec[1])
        self.last_spec = (tok, seqs)
