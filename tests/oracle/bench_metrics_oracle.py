#!/usr/bin/python3
"""Benchmark result metrics computed with numpy, the oracle of tests/bench/bench_data_test.cpp.

Written from the metric definitions of vLLM's `vllm bench serve` (docs/bench.md, "Workloads and
metrics"), independently of src/bench/metrics.cpp. Run with Debian's interpreter
(python3-numpy):

    /usr/bin/python3 tests/oracle/bench_metrics_oracle.py < IN.json > OUT.json

IN: {"duration": s, "percentiles": [..], "metrics": ["ttft", ...], "goodput": {"ttft": ms, ...},
     "request_rate": number or null, "max_concurrency": int or null,
     "results": [{"success", "start", "ttft", "latency", "itl": [..], "prompt_tokens",
                  "output_tokens"}, ...]}
OUT: the result keys ("completed", "mean_ttft_ms", "p99_ttft_ms", ...) and "table", the
terminal summary printed with vLLM's format strings.
"""
import json
import math
import sys

import numpy as np


def tbt_of(gaps):
    # Mooncake: mean of the slowest 10 % of a request's gaps (at least one).
    if not gaps:
        return 0.0
    k = max(1, math.ceil(len(gaps) / 10))
    return float(np.mean(sorted(gaps, reverse=True)[:k]))


def main():
    cfg = json.load(sys.stdin)
    dur = cfg["duration"]
    pcts = cfg["percentiles"]
    selected = cfg["metrics"]
    slo = cfg.get("goodput") or {}
    ok = [r for r in cfg["results"] if r["success"]]

    ttfts = [r["ttft"] for r in ok]
    e2els = [r["latency"] for r in ok]
    itls = [g for r in ok for g in r["itl"]]
    tpots = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1)
             for r in ok if r["output_tokens"] > 1]
    tbts = [tbt_of(r["itl"]) for r in ok if r["itl"]]

    def value_for_goodput(r, name):
        if name == "ttft":
            return r["ttft"]
        if name == "e2el":
            return r["latency"]
        if name == "tbt":
            return tbt_of(r["itl"])
        if r["output_tokens"] > 1:
            return (r["latency"] - r["ttft"]) / (r["output_tokens"] - 1)
        return 0.0

    good = sum(1 for r in ok
               if all(value_for_goodput(r, n) <= ms / 1000.0 for n, ms in slo.items()))

    total_in = sum(r["prompt_tokens"] for r in ok)
    total_out = sum(r["output_tokens"] for r in ok)
    out = {
        "duration": dur,
        "completed": len(ok),
        "failed": len(cfg["results"]) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": good / dur if slo else None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    }

    # Peak tokens per second in 1 s buckets from the first send (unlike vLLM, which counts a
    # chunk as one token); peak concurrency by brute force over every start time (an interval
    # [s, e) is in flight at t when s <= t < e), the instantaneous peak of current vLLM's sweep
    # over start and end events, not older vLLM's busiest 1 s bucket of requests touching that
    # second.
    peak_tokens = 0.0
    peak_conc = 0
    if ok:
        t0 = min(r["start"] for r in ok)
        t1 = max(r["start"] + r["latency"] for r in ok)
        n_buckets = int(np.ceil(t1 - t0)) + 1
        counts = np.zeros(n_buckets)
        for r in ok:
            # A chunk may carry several tokens (speculative decoding): the output tokens are
            # spread over the chunks, chunk k of C getting floor((k+1)T/C) - floor(kT/C).
            times = np.cumsum([r["start"] + r["ttft"]] + list(r["itl"]))
            n_out, n_chunks = r["output_tokens"], len(times)
            for k, t in enumerate(times):
                b = int(t - t0)
                if 0 <= b < n_buckets:
                    counts[b] += (k + 1) * n_out // n_chunks - k * n_out // n_chunks
        peak_tokens = float(counts.max())
        for r in ok:
            t = r["start"]
            peak_conc = max(peak_conc, sum(1 for q in ok
                                           if q["start"] <= t < q["start"] + q["latency"]))
    out["max_output_tokens_per_s"] = peak_tokens
    out["max_concurrent_requests"] = peak_conc

    lists = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els, "tbt": tbts}
    sections = [("ttft", "TTFT", "Time to First Token"),
                ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                ("itl", "ITL", "Inter-token Latency"),
                ("e2el", "E2EL", "End-to-end Latency"),
                ("tbt", "TBT", "Time between Tokens (Mooncake)")]

    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append("{:<40} {:<10}".format("Successful requests:", out["completed"]))
    lines.append("{:<40} {:<10}".format("Failed requests:", out["failed"]))
    if cfg.get("max_concurrency") is not None:
        lines.append("{:<40} {:<10}".format("Maximum request concurrency:",
                                            cfg["max_concurrency"]))
    if cfg.get("request_rate") is not None:
        lines.append("{:<40} {:<10.2f}".format("Request rate configured (RPS):",
                                               cfg["request_rate"]))
    lines.append("{:<40} {:<10.2f}".format("Benchmark duration (s):", dur))
    lines.append("{:<40} {:<10}".format("Total input tokens:", total_in))
    lines.append("{:<40} {:<10}".format("Total generated tokens:", total_out))
    lines.append("{:<40} {:<10.2f}".format("Request throughput (req/s):",
                                           out["request_throughput"]))
    if slo:
        lines.append("{:<40} {:<10.2f}".format("Request goodput (req/s):", out["request_goodput"]))
    lines.append("{:<40} {:<10.2f}".format("Output token throughput (tok/s):",
                                           out["output_throughput"]))
    lines.append("{:<40} {:<10.2f}".format("Peak output token throughput (tok/s):", peak_tokens))
    lines.append("{:<40} {:<10.2f}".format("Peak concurrent requests:", peak_conc))
    lines.append("{:<40} {:<10.2f}".format("Total token throughput (tok/s):",
                                           out["total_token_throughput"]))
    for key, label, header in sections:
        if key not in selected:
            continue
        vals = lists[key] or 0
        mean = float(np.mean(vals)) * 1000
        median = float(np.median(vals)) * 1000
        out[f"mean_{key}_ms"] = mean
        out[f"median_{key}_ms"] = median
        out[f"std_{key}_ms"] = float(np.std(vals)) * 1000
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append("{:<40} {:<10.2f}".format(f"Mean {label} (ms):", mean))
        lines.append("{:<40} {:<10.2f}".format(f"Median {label} (ms):", median))
        for p in pcts:
            word = str(int(p)) if int(p) == p else str(p)
            v = float(np.percentile(vals, p)) * 1000
            out[f"p{word}_{key}_ms"] = v
            lines.append("{:<40} {:<10.2f}".format(f"P{word} {label} (ms):", v))
    lines.append("=" * 50)
    out["table"] = "\n".join(lines) + "\n"
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
