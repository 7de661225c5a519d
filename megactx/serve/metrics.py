"""Prometheus metrics of a `megactx serve` process (GET /metrics).

Each server owns its own `CollectorRegistry`, so several servers can live in one process (tests)
and nothing is registered globally. prometheus_client's metrics are thread-safe: the engine thread
sets the engine gauges after each step, the event loop records request events.

Gauges: running / waiting sequences, KV blocks used / free, prefix-cache hit rate.
Counters: prompt and generation tokens, finished completions by finish reason, rejected requests by
reason. Histograms: time to first token, inter-token latency, end-to-end request latency, the
event loop's lag (how late it runs a timer: a busy loop delays every request and event) and the
pauses of the process's cyclic garbage collector (everything in the process stands still). The
inter-token latency gets a whole engine step's gaps in a few calls (`CountedHistogram`): a step at
batch 64 would otherwise cost the event loop 64 locked observations.
Speculative decoding (an engine that drafts, see `watch_spec_decode`): counters of drafts, draft
tokens and accepted tokens, accepted tokens per draft position, and the mean acceptance length.
"""

from __future__ import annotations

import bisect
import gc
import math
import time
import weakref
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from megactx.engine.spec_decode import SpecDecodeStats

# Bucket edges in seconds. Time to first token spans a decode-sized prefill (milliseconds) up to the
# prefill of a million-token prompt (minutes), so the edges go that far.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
# A decode step of a large batch at long context stays well under a few seconds.
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0,
                 2560.0)

# How late the event loop runs a timer. Its resolution is ~1 ms (epoll waits in whole milliseconds),
# so an idle loop shows up to 1 ms.
LOOP_LAG_BUCKETS_S = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0)

# A collection of the young generations takes microseconds; a full one walks every object not frozen.
GC_PAUSE_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The metrics of one server. `model_name` labels every series, as vLLM's do, so one Prometheus
    can tell several served models apart."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.num_running = gauge("megactx_num_requests_running",
                                 "Sequences in the running batch (a request with n completions counts n)")
        self.num_waiting = gauge("megactx_num_requests_waiting",
                                 "Sequences waiting for a batch slot or KV blocks (n completions count n)")
        self.kv_blocks_used = gauge("megactx_kv_blocks_used", "Paged KV blocks held by sequences")
        self.kv_blocks_free = gauge("megactx_kv_blocks_free",
                                    "Paged KV blocks free to allocate (including prefix-cached ones no one holds)")
        self.prefix_cache_hit_rate = gauge("megactx_prefix_cache_hit_rate",
                                           "Fraction of looked-up prompt tokens found in the prefix cache, since start")
        self.prompt_tokens = counter("megactx_prompt_tokens", "Prompt tokens of accepted requests")
        self.generation_tokens = counter("megactx_generation_tokens", "Generated tokens")
        self.ttft = histogram("megactx_time_to_first_token_seconds",
                              "From a request's arrival to its first generated token", TTFT_BUCKETS_S)
        self.itl = CountedHistogram("megactx_inter_token_latency_seconds",
                                    "Between consecutive tokens of one completion", ITL_BUCKETS_S, model_name)
        self.registry.register(self.itl)
        self.e2e = histogram("megactx_e2e_request_latency_seconds",
                             "From a request's arrival to its last token (or its abort)", E2E_BUCKETS_S)
        self.loop_lag = histogram("megactx_event_loop_lag_seconds",
                                  "How late the server's event loop ran a timer due every 10 ms: what a request's "
                                  "arrival and each streamed event wait for (resolution ~1 ms)", LOOP_LAG_BUCKETS_S)
        self.gc_pause = histogram("megactx_gc_pause_seconds",
                                  "Pauses of the server process's cyclic garbage collector, through which its event "
                                  "loop (and an engine thread) stands still", GC_PAUSE_BUCKETS_S)
        self._gc_pauses: list[float] = []  # noted by the collector's callback, not yet in gc_pause
        _GcWatch.install(self)
        self._finished = Counter("megactx_completions_finished",
                                 "Finished completions (a request has n) by finish reason",
                                 labels + ["finish_reason"], registry=self.registry)
        self._rejected = Counter("megactx_requests_rejected", "Requests refused before running, by reason",
                                 labels + ["reason"], registry=self.registry)
        self.model_name = model_name

    def observe_engine(self, num_running: int, num_waiting: int, kv_blocks_used: int, kv_blocks_free: int,
                       prefix_cache_hit_rate: float) -> None:
        """The engine's state after a step (called from the engine thread)."""
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        self.kv_blocks_used.set(kv_blocks_used)
        self.kv_blocks_free.set(kv_blocks_free)
        self.prefix_cache_hit_rate.set(prefix_cache_hit_rate)

    def completion_finished(self, finish_reason: str) -> None:
        """finish_reason: "stop" | "length" | "abort" (the client went away, or the server stopped)."""
        self._finished.labels(self.model_name, finish_reason).inc()

    def request_rejected(self, reason: str) -> None:
        """reason: "invalid" (a 4xx) | "overloaded" (a 503)."""
        self._rejected.labels(self.model_name, reason).inc()

    def watch_spec_decode(self, stats: SpecDecodeStats) -> None:
        """Expose an engine's speculative-decoding counters (`LLM.stats.spec_decode`), read at each scrape."""
        self.registry.register(_SpecDecodeCollector(stats, self.model_name))

    def flush_gc_pauses(self) -> None:
        """Move the collector pauses noted since the last call into gc_pause. (Not from the
        collector's callback itself: a histogram takes a lock, which the code a collection
        interrupts may be holding.) The loop calls it with its lag probe, a scrape before rendering."""
        pauses = self._gc_pauses
        while pauses:
            self.gc_pause.observe(pauses.pop())

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        self.flush_gc_pauses()
        return generate_latest(self.registry)


class _GcWatch:
    """A `gc.callbacks` entry that notes every collection's pause in its metrics' _gc_pauses (a
    list.append, under the GIL: no lock). It holds the metrics weakly and does nothing once they are
    gone; such watches are dropped when the next server's metrics install theirs (`install`)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = weakref.ref(metrics)
        self.started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        owner = self.metrics()
        if owner is None:
            return
        if phase == "start":
            self.started = time.perf_counter()
        else:
            owner._gc_pauses.append(time.perf_counter() - self.started)

    @classmethod
    def install(cls, metrics: ServerMetrics) -> None:
        gc.callbacks[:] = [cb for cb in gc.callbacks if not (isinstance(cb, cls) and cb.metrics() is None)]
        gc.callbacks.append(cls(metrics))


class CountedHistogram:
    """A Prometheus histogram (a collector: register it) whose `observe(value, count)` records `count`
    equal observations in one call. Its exposition is prometheus_client's Histogram's (buckets,
    count, sum, created), labelled with the model name. Not locked: only the event loop's thread
    writes it, and /metrics reads it on that thread."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], model_name: str):
        self.name, self.documentation, self.model_name = name, documentation, model_name
        self.upper_bounds = [*buckets, math.inf]
        self.counts = [0] * len(self.upper_bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float, count: int = 1) -> None:
        """value: seconds; it falls in the first bucket whose upper bound is >= value."""
        self.counts[bisect.bisect_left(self.upper_bounds, value)] += count
        self.sum += value * count

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip(self.upper_bounds, self.counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric([self.model_name], buckets, self.sum)
        family.add_sample(f"{self.name}_created", {"model_name": self.model_name}, self.created)
        yield family


class _SpecDecodeCollector:
    """Reads SpecDecodeStats when /metrics is scraped. The engine thread only adds to its counters, so
    each value is whole; values of one scrape may be a step apart."""

    def __init__(self, stats: SpecDecodeStats, model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self):
        stats, name = self.stats, self.model_name
        for metric, doc, value in (
                ("megactx_spec_decode_num_drafts", "Verifies of a sequence with at least one draft token",
                 stats.num_drafts),
                ("megactx_spec_decode_num_draft_tokens", "Draft tokens verified", stats.num_draft_tokens),
                ("megactx_spec_decode_num_accepted_tokens", "Draft tokens accepted", stats.num_accepted_tokens)):
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
        per_position = CounterMetricFamily("megactx_spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted at each draft position (0 = the first)",
                                           labels=["model_name", "position"])
        for position, value in enumerate(stats.accepted_per_position):
            per_position.add_metric([name, str(position)], value)
        yield per_position
        mean = GaugeMetricFamily("megactx_spec_decode_mean_acceptance_length",
                                 "Tokens a verify emits on average (accepted drafts + 1), since start",
                                 labels=["model_name"])
        mean.add_metric([name], stats.mean_acceptance_length)
        yield mean
