#!/usr/bin/env python3
"""The client side of bench/connections.sh: thousands of raw HTTP/1.1 connections against a
running gateway (asyncio, one process), in phases, each printing one JSON line:

  idle      IDLE keep-alive connections, each after one GET /health, held open; the gateway's
            resident memory before and after gives its memory per connection
  streams   STREAMS concurrent streaming completions while the idle ones are held: each must end
            with data: [DONE] and the chunked terminator, or with an OpenAI error
  normal    sequential ordinary requests while all of the above is held: still served
  over_cap  connections past the gateway's connection cap: closed by the gateway within seconds
  slowloris connections sending their head a byte a second: cut by the header timeout, while
            ordinary requests are still served
  burst     more concurrent requests than the gateway queues: the rest get 429 with an OpenAI
            error body

Usage: connection_load.py HOST PORT GATEWAY_PID [--idle N] [--streams N] [--cap N] ...
"""
import argparse
import asyncio
import json
import resource
import statistics
import time

from http_load import is_openai_error, read_response, request_bytes, rss_kib, stream


def emit(phase, **fields):
    print(json.dumps({"phase": phase, **fields}), flush=True)


async def open_idle(host, port, n):
    conns, failed = [], 0
    sem = asyncio.Semaphore(500)  # connect in waves: the listen backlog is finite

    async def one():
        nonlocal failed
        async with sem:
            try:
                r, w = await asyncio.wait_for(asyncio.open_connection(host, port), 30)
                w.write(request_bytes("GET", "/health"))
                status, _ = await read_response(r, 30)
                if status != 200:
                    raise RuntimeError(status)
                conns.append((r, w))
            except Exception:
                failed += 1

    await asyncio.gather(*(one() for _ in range(n)))
    return conns, failed


async def normal_requests(host, port, n):
    latencies, bad = [], 0
    for _ in range(n):
        t = time.monotonic()
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
            w.write(request_bytes("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}))
            status, _ = await read_response(r, 30)
            w.close()
            if status != 200:
                bad += 1
        except Exception:
            bad += 1
        latencies.append((time.monotonic() - t) * 1000)
    return latencies, bad


async def closed_by_server(host, port, wait_s):
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    except Exception:
        return True  # refused outright counts as closed
    try:
        data = await asyncio.wait_for(r.read(1), wait_s)
        return data == b""
    except asyncio.TimeoutError:
        return False
    except Exception:
        return True
    finally:
        w.close()


async def slow_head(host, port, seconds):
    """Sends a head a byte a second; returns the seconds until the server closed (or None)."""
    r, w = await asyncio.open_connection(host, port)
    head = request_bytes("GET", "/health")
    start = time.monotonic()
    for i in range(min(seconds, len(head) - 3)):
        try:
            w.write(head[i:i + 1])
            await w.drain()
            data = await asyncio.wait_for(r.read(1), 1.0)
            if data == b"":
                return time.monotonic() - start
        except asyncio.TimeoutError:
            continue
        except Exception:
            return time.monotonic() - start
    w.close()
    return None


async def burst(host, port, n, max_tokens):
    async def one():
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection(host, port), 30)
            w.write(request_bytes("POST", "/v1/completions",
                                  {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True}))
            status, body = await read_response(r, 300)
            w.close()
            return status, is_openai_error(body) if status != 200 else True
        except Exception:
            return 0, False

    results = await asyncio.gather(*(one() for _ in range(n)))
    statuses = {}
    for s, _ in results:
        statuses[str(s)] = statuses.get(str(s), 0) + 1
    return statuses, all(ok for _, ok in results)


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("pid", type=int)
    p.add_argument("--idle", type=int, default=10000)
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--stream-tokens", type=int, default=32)
    p.add_argument("--cap", type=int, default=0, help="the gateway's connection cap (0: skip)")
    p.add_argument("--over-cap", type=int, default=500)
    p.add_argument("--slowloris", type=int, default=1000)
    p.add_argument("--slow-seconds", type=int, default=20)
    p.add_argument("--burst", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300)
    a = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    before = rss_kib(a.pid)
    t = time.monotonic()
    idle, failed = await open_idle(a.host, a.port, a.idle)
    after = rss_kib(a.pid)
    emit("idle", asked=a.idle, held=len(idle), failed=failed, seconds=round(time.monotonic() - t, 1),
         gateway_rss_before_mib=round(before / 1024, 1), gateway_rss_after_mib=round(after / 1024, 1),
         kib_per_connection=round((after - before) / max(len(idle), 1), 2))

    t = time.monotonic()
    streams = asyncio.gather(*(stream(a.host, a.port, a.stream_tokens, a.timeout)
                               for _ in range(a.streams)))
    await asyncio.sleep(2)  # the streams are running: ordinary requests must still be served
    latencies, bad = await normal_requests(a.host, a.port, 20)
    outcomes = [o for o, _ in await streams]
    counts = {k: outcomes.count(k) for k in ("done", "error", "cut", "hung")}
    emit("streams", asked=a.streams, **counts, seconds=round(time.monotonic() - t, 1),
         idle_still_open=sum(1 for r, _ in idle if not r.at_eof()),
         gateway_rss_mib=round(rss_kib(a.pid) / 1024, 1))
    emit("normal", requests=len(latencies), failed=bad,
         p50_ms=round(statistics.median(latencies), 1), max_ms=round(max(latencies), 1))

    if a.cap:
        open_now = len(idle)
        extra_needed = max(0, a.cap - open_now)
        fill, fill_failed = await open_idle(a.host, a.port, extra_needed)
        t = time.monotonic()
        closed = await asyncio.gather(*(closed_by_server(a.host, a.port, 5)
                                        for _ in range(a.over_cap)))
        latencies, bad = await normal_requests(a.host, a.port, 1)  # at the cap: refused too
        emit("over_cap", cap=a.cap, held=open_now + len(fill), fill_failed=fill_failed,
             extra=a.over_cap, closed_within_5s=sum(closed),
             seconds=round(time.monotonic() - t, 1))
        for _, w in fill:
            w.close()
        await asyncio.sleep(1)

    for _, w in idle:
        w.close()
    await asyncio.sleep(1)

    if a.slowloris:
        t = time.monotonic()
        slow = asyncio.gather(*(slow_head(a.host, a.port, a.slow_seconds)
                                for _ in range(a.slowloris)))
        await asyncio.sleep(2)
        latencies, bad = await normal_requests(a.host, a.port, 20)
        cut = await slow
        cut_after = [c for c in cut if c is not None]
        emit("slowloris", connections=a.slowloris, cut=len(cut_after),
             max_seconds_held=round(max(cut_after), 1) if cut_after else None,
             normal_requests=len(latencies), normal_failed=bad,
             normal_p50_ms=round(statistics.median(latencies), 1),
             seconds=round(time.monotonic() - t, 1))

    if a.burst:
        statuses, errors_are_openai = await burst(a.host, a.port, a.burst, a.stream_tokens)
        emit("burst", requests=a.burst, statuses=statuses, refusals_are_openai_errors=errors_are_openai)


asyncio.run(main())
