#!/usr/bin/env python3
"""The client and fault driver of bench/chaos.sh: CLIENTS streaming clients send completions
back to back through a running `tandem serve` for DURATION seconds while a driver, every
FAULT_INTERVAL seconds, picks a random engine and kills it (SIGKILL: serve restarts it), stalls it
(SIGSTOP for 5-30 s, then SIGCONT) or cuts the KV transfer connections of a prefill engine
(ss -K). Every stream must end within BOUND seconds: with data: [DONE] and the chunked end, or
with an OpenAI error (an error status with the error body, or an SSE error event as the last
event). Prints one JSON line with the counts.

Usage: chaos_load.py HOST PORT SERVE_PID SERVE_LOG [--clients N] [--duration S] [--seed N] ...
"""
import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import time

from http_load import rss_kib, stream


def engines(log_path):
    """The engines serve runs now: {port: {"pid": pid, "kv_port": port or None}}."""
    found = {}
    with open(log_path) as f:
        for line in f:
            m = re.search(r"(prefill|decode) engine http://[^:]+:(\d+) \(pid (\d+)(?:, KV transfer port (\d+))?", line)
            if m:
                found[int(m.group(2))] = {"pid": int(m.group(3)),
                                          "kv_port": int(m.group(4)) if m.group(4) else None}
            m = re.search(r"engine on port (\d+) restarted \(pid (\d+)\)", line)
            if m and int(m.group(1)) in found:
                found[int(m.group(1))]["pid"] = int(m.group(2))
    return found


async def client(host, port, until, bound, pause, rng, counts, errors):
    while time.monotonic() < until:
        outcome, detail = await stream(host, port, rng.randint(8, 64), bound)
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome != "done":
            errors[detail] = errors.get(detail, 0) + 1
            await asyncio.sleep(pause)  # as a client would before it tries again


async def fault_driver(log_path, until, interval, rng, faults):
    while time.monotonic() < until - 35:  # the last stall ends before the clients stop
        await asyncio.sleep(interval)
        running = engines(log_path)
        if not running:
            continue
        port = rng.choice(sorted(running))
        e = running[port]
        kinds = ["kill", "stall"] + (["cut_kv"] if e["kv_port"] else [])
        kind = rng.choice(kinds)
        try:
            if kind == "kill":
                os.kill(e["pid"], signal.SIGKILL)
            elif kind == "stall":
                seconds = rng.uniform(5, 30)
                os.kill(e["pid"], signal.SIGSTOP)
                asyncio.get_running_loop().call_later(seconds, lambda p=e["pid"]: resume(p))
            else:
                subprocess.run(["ss", "-K", "-t", "state", "established",
                                f"( sport = :{e['kv_port']} or dport = :{e['kv_port']} )"],
                               capture_output=True, check=False)
            faults[kind] = faults.get(kind, 0) + 1
        except ProcessLookupError:
            pass  # it died meanwhile; serve restarts it


def resume(pid):
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("pid", type=int)
    p.add_argument("log")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--duration", type=float, default=180)
    p.add_argument("--fault-interval", type=float, default=4)
    p.add_argument("--bound", type=float, default=120, help="seconds a stream may take")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--error-pause", type=float, default=1.0,
                   help="seconds a client waits after an error before its next request")
    a = p.parse_args()
    rng = random.Random(a.seed)
    counts, faults, errors = {}, {}, {}
    rss_start = rss_kib(a.pid)
    until = time.monotonic() + a.duration
    clients = [client(a.host, a.port, until, a.bound, a.error_pause,
                      random.Random(a.seed * 1000 + i), counts, errors)
               for i in range(a.clients)]
    await asyncio.gather(fault_driver(a.log, until, a.fault_interval, rng, faults), *clients)
    restarts = 0
    with open(a.log) as f:
        restarts = sum(1 for line in f if "restarted (pid" in line)
    print(json.dumps({
        "clients": a.clients, "seconds": a.duration, "requests": sum(counts.values()),
        "completed": counts.get("done", 0), "openai_errors": counts.get("error", 0),
        "cut_without_error": counts.get("cut", 0), "hung": counts.get("hung", 0),
        "bound_s": a.bound, "faults": faults, "restarts": restarts,
        "gateway_rss_start_mib": round(rss_start / 1024, 1),
        "gateway_rss_end_mib": round(rss_kib(a.pid) / 1024, 1)}), flush=True)
    for detail, n in sorted(errors.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {n:6d}  {detail}", flush=True)


asyncio.run(main())
