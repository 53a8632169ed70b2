"""``/metrics``: what an operator scrapes, in Prometheus' text format (0.0.4) under vLLM's metric names.

vLLM's names (``vllm:``, each with a ``model_name`` label) so that the dashboards and alerts written for vLLM read
gdn_export's server unchanged: requests running and waiting (gauges), prompt and generation tokens (counters: tokens
per second is ``rate(vllm:generation_tokens_total[1m])``, Prometheus' convention), requests finished by reason, and
the time to first token and end-to-end latency as histograms with vLLM's buckets. Everything is counted on the event
loop (one thread: no lock), from what the HTTP side sees of each request.
"""

from __future__ import annotations

import bisect
import collections

# vLLM's buckets (vllm/engine/metrics.py, v0.x and v1): seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets, self.counts, self.total, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.buckets, value)  # the first bucket whose bound is >= value
        if index < len(self.counts):
            self.counts[index] += 1
        self.total, self.count = self.total + value, self.count + 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


def _label(value: str) -> str:
    """A label value escaped as the text format wants (backslash, double quote, line feed)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ServerMetrics:
    """The counters of one server; ``render(running, waiting)`` the exposition."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{_label(model_name)}"'
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: collections.Counter = collections.Counter()  # finish reason -> requests
        self.time_to_first_token = Histogram(TTFT_BUCKETS)
        self.e2e_latency = Histogram(LATENCY_BUCKETS)

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def request_finished(self, prompt_tokens: int, generation_tokens: int, reason: str, seconds: float) -> None:
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.finished[reason] += 1
        self.e2e_latency.observe(seconds)

    def render(self, running: int, waiting: int) -> str:
        lab = self.labels
        lines = [
            "# HELP vllm:num_requests_running Number of requests being generated.",
            "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{lab}}} {running}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{lab}}} {waiting}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter", f"vllm:prompt_tokens_total{{{lab}}} {self.prompt_tokens}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{lab}}} {self.generation_tokens}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            *(f'vllm:request_success_total{{{lab},finished_reason="{_label(reason)}"}} {n}'
              for reason, n in sorted(self.finished.items())),
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            *self.time_to_first_token.lines("vllm:time_to_first_token_seconds", lab),
            "# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency in seconds.",
            "# TYPE vllm:e2e_request_latency_seconds histogram",
            *self.e2e_latency.lines("vllm:e2e_request_latency_seconds", lab),
        ]
        return "\n".join(lines) + "\n"
