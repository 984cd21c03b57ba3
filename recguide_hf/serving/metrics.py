"""What the server measures, in Prometheus' text format (`GET /metrics`), with no dependency.

Latency definitions follow vLLM's serving benchmark: TTFT = first token time - arrival; ITL = the gap between two
emissions of one request (a speculative round's burst of tokens is one emission); TPOT = (last token - first
token) / (output tokens - 1); e2e = last token - arrival.
"""

from __future__ import annotations

import bisect
from collections import Counter

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float):
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """Counters, gauges and latency histograms of one worker (written by its thread, read by the server)."""

    def __init__(self):
        self.ttft, self.itl, self.tpot, self.e2e = Histogram(), Histogram(), Histogram(), Histogram()
        self.round_seconds = Histogram()
        self.finished = self.cancelled = self.rejected = self.tokens = 0
        self.blocks: Counter = Counter()  # rounds per block size, over finished requests

    def render(self, running: int, waiting: int, open_streams: int, slots: int | None = None) -> str:
        p = "recguide_"
        lines = [
            f"# HELP {p}requests_running Requests decoding (rows of the batch).", f"# TYPE {p}requests_running gauge",
            f"{p}requests_running {running}",
            f"# HELP {p}requests_waiting Requests queued for a row.", f"# TYPE {p}requests_waiting gauge",
            f"{p}requests_waiting {waiting}",
            f"# HELP {p}open_streams Streaming responses open.", f"# TYPE {p}open_streams gauge",
            f"{p}open_streams {open_streams}",
        ]
        if slots is not None:
            lines += [f"# HELP {p}free_rows Rows (slots) with no request decoding.", f"# TYPE {p}free_rows gauge",
                      f"{p}free_rows {max(0, slots - running)}"]
        for name, value, text in (("requests_finished", self.finished, "Requests that ran to their end."),
                                  ("requests_cancelled", self.cancelled, "Requests stopped (client left or stop)."),
                                  ("requests_rejected", self.rejected, "Requests refused because the queue was full."),
                                  ("generation_tokens", self.tokens, "Tokens generated.")):
            lines += [f"# HELP {p}{name}_total {text}", f"# TYPE {p}{name}_total counter",
                      f"{p}{name}_total {value}"]
        lines += [f"# HELP {p}block_rounds_total Rounds per block size (B = 1: a plain step), finished requests.",
                  f"# TYPE {p}block_rounds_total counter"]
        lines += [f'{p}block_rounds_total{{block="{b}"}} {n}' for b, n in sorted(self.blocks.items())]
        for hist, name, text in ((self.ttft, "time_to_first_token_seconds", "Arrival to first token."),
                                 (self.itl, "inter_token_latency_seconds", "Gap between two emissions of a request."),
                                 (self.tpot, "time_per_output_token_seconds", "(last - first token) / (tokens - 1)."),
                                 (self.e2e, "e2e_request_latency_seconds", "Arrival to last token."),
                                 (self.round_seconds, "round_seconds", "One round of one engine.")):
            lines += hist.lines(p + name, text)
        return "\n".join(lines) + "\n"
