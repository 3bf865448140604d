"""`llm.get_metrics()`: vLLM's counters, gauges and histograms, read in-process.

vLLM exposes its engine metrics to Prometheus and, offline, as `LLM.get_metrics()`
(a list of Counter / Gauge / Histogram with vLLM's names). The same names are
used here so dashboards and scripts written against vLLM read these. Latencies
are observed where they happen: inter-token gaps in the engine core (which sees
every token, whichever process it runs in), time to first token and end-to-end
latency in the front end when a request's output is made.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Seconds; one set for every latency histogram (vLLM's time-to-first-token buckets, extended).
BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
           10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass
class Counter:
    name: str
    value: int
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Gauge:
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Histogram:
    """Prometheus-style: `buckets[le]` counts observations <= le (cumulative), "+Inf" all."""
    name: str
    count: int
    sum: float
    buckets: dict[str, int]
    labels: dict[str, str] = field(default_factory=dict)


class LatencyHistogram:
    """Observations in fixed buckets, mergeable across replicas (a plain dict on the wire)."""

    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds

    def to_dict(self) -> dict:
        return {"counts": list(self.counts), "sum": self.sum}

    @staticmethod
    def merged(name: str, parts: list[dict]) -> Histogram:
        counts = [sum(p["counts"][i] for p in parts) for i in range(len(BUCKETS) + 1)]
        cumulative, running = {}, 0
        for le, n in zip([*map(str, BUCKETS), "+Inf"], counts):
            running += n
            cumulative[le] = running
        return Histogram(name, running, sum(p["sum"] for p in parts), cumulative)


class FrontEndStats:
    """What the front end counts as outputs are made (one per LLMEngine)."""

    def __init__(self):
        self.finished: dict[str, int] = {}  # finish reason -> requests (samples)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = LatencyHistogram()
        self.e2e = LatencyHistogram()

    def metrics(self, core_stats: list[dict]) -> list:
        """The list get_metrics returns, with the cores' counters summed over replicas."""
        total = {key: sum(s[key] for s in core_stats)
                 for key in ("preemptions", "prefix_queries_tokens", "prefix_hits_tokens", "running", "waiting")}
        out = [Gauge("vllm:num_requests_running", total["running"]),
               Gauge("vllm:num_requests_waiting", total["waiting"]),
               Counter("vllm:prompt_tokens", self.prompt_tokens),
               Counter("vllm:generation_tokens", self.generation_tokens),
               Counter("vllm:num_preemptions", total["preemptions"]),
               Counter("vllm:prefix_cache_queries", total["prefix_queries_tokens"]),
               Counter("vllm:prefix_cache_hits", total["prefix_hits_tokens"])]
        queries = total["prefix_queries_tokens"]
        out.append(Gauge("vllm:prefix_cache_hit_rate", total["prefix_hits_tokens"] / queries if queries else 0.0))
        out += [Counter("vllm:request_success", n, {"finished_reason": reason})
                for reason, n in sorted(self.finished.items())]
        out.append(LatencyHistogram.merged("vllm:time_to_first_token_seconds", [self.ttft.to_dict()]))
        out.append(LatencyHistogram.merged("vllm:inter_token_latency_seconds",
                                           [s["inter_token_latency"] for s in core_stats]))
        out.append(LatencyHistogram.merged("vllm:e2e_request_latency_seconds", [self.e2e.to_dict()]))
        return out
