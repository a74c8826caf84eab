"""The server's Prometheus metrics: vLLM's metric names (``vllm:X`` is ``graphpar:X`` here)
where vLLM has one, read from the engine after every iteration of its loop."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from graphpar.serving.engine import LLMEngine
from graphpar.serving.outputs import EngineStats, RequestOutput

__all__ = ["ServerMetrics"]

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    """One registry per server (so that several servers live in one process, as in tests).

    Gauges are set from the engine's state; counters advance by what the engine's counters
    moved since the last look; histograms observe each finished request (measured seconds).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("graphpar:num_requests_running",
                             "Requests running in the model's steps.", labels, registry=r)
        self.waiting = Gauge("graphpar:num_requests_waiting",
                             "Requests waiting to be scheduled (or re-prefilled).", labels,
                             registry=r)
        self.swapped = Gauge("graphpar:num_requests_swapped",
                             "Requests preempted to CPU swap blocks.", labels, registry=r)
        self.kv_usage = Gauge("graphpar:kv_cache_usage_perc",
                              "Fraction of device KV blocks in use (0-1).", labels, registry=r)
        self.blocks_used = Gauge("graphpar:kv_cache_blocks_used", "Device KV blocks in use.",
                                 labels, registry=r)
        self.blocks_free = Gauge("graphpar:kv_cache_blocks_free", "Device KV blocks free.",
                                 labels, registry=r)
        self.prefix_queries = Counter("graphpar:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", labels,
                                      registry=r)
        self.prefix_hits = Counter("graphpar:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.", labels, registry=r)
        self.prompt_tokens = Counter("graphpar:prompt_tokens", "Prompt tokens prefilled.",
                                     labels, registry=r)
        self.generation_tokens = Counter("graphpar:generation_tokens", "Tokens generated.",
                                         labels, registry=r)
        self.preemptions = Counter("graphpar:num_preemptions", "Requests preempted.", labels,
                                   registry=r)
        self.success = Counter("graphpar:request_success", "Requests finished, by reason.",
                               labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("graphpar:time_to_first_token_seconds",
                              "Time to first token (seconds, measured from arrival).", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("graphpar:time_per_output_token_seconds",
                              "Time per output token after the first (seconds, measured).",
                              labels, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("graphpar:e2e_request_latency_seconds",
                             "Request latency, arrival to last token (seconds, measured).",
                             labels, buckets=LATENCY_BUCKETS, registry=r)
        self._last: dict[str, EngineStats] = {}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def update(self, model: str, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """After an iteration of ``model``'s engine loop (its thread)."""
        s, sched = engine.stats, engine.scheduler
        self.running.labels(model).set(len(sched.running))
        self.waiting.labels(model).set(len(sched.waiting) + len(sched.recompute))
        self.swapped.labels(model).set(len(sched.swapped))
        free, total = sched.num_free_blocks, sched.num_device_blocks
        self.blocks_used.labels(model).set(total - free)
        self.blocks_free.labels(model).set(free)
        self.kv_usage.labels(model).set((total - free) / max(total, 1))
        last = self._last.get(model, EngineStats())
        for counter, field in ((self.prefix_queries, "prefix_cache_queries"),
                               (self.prefix_hits, "prefix_cache_hits"),
                               (self.prompt_tokens, "prompt_tokens"),
                               (self.generation_tokens, "generated_tokens"),
                               (self.preemptions, "preemptions")):
            moved = getattr(s, field) - getattr(last, field)
            child = counter.labels(model)  # exported (at 0) from the first look on
            if moved > 0:
                child.inc(moved)
        self._last[model] = EngineStats(**{f: getattr(s, f) for f in (
            "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generated_tokens",
            "preemptions")})
        for out in outputs:
            if out.finished:
                self.finished(model, out)

    def finished(self, model: str, out: RequestOutput) -> None:
        if out.error is not None:
            self.success.labels(model, "error").inc()
            return
        reasons = {c.finish_reason or "abort" for c in out.outputs}
        if "abort" in reasons:  # the client went away: no latency to speak of
            self.success.labels(model, "abort").inc()
            return
        for c in out.outputs:
            self.success.labels(model, c.finish_reason).inc()
        if out.time_to_first_token is not None:
            self.ttft.labels(model).observe(out.time_to_first_token)
        if out.latency is not None:
            self.e2e.labels(model).observe(out.latency)
        tokens = max(len(c.token_ids) for c in out.outputs) if out.outputs else 0
        if tokens > 1 and out.finish_time is not None and out.first_token_time is not None:
            self.tpot.labels(model).observe((out.finish_time - out.first_token_time)
                                            / (tokens - 1))
