#!/usr/bin/env python3
"""Serves the gateway dashboard page with a fake, changing gateway state.

Lets the page be checked in a headless browser without building or running the
gateway. Each /dashboard/state call advances the fake clock by one second, so
rates and percentiles stay stable however fast the browser polls.

  python3 dashboard_fake_server.py [--port 0] [--key ADMINKEY]

Prints "port N" once listening. /fake/hits returns how often each engine's
expert load was asked for, to check the page's back-off.
"""
import argparse
import json
import math
import os
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                    "..", "..", "src", "gateway", "dashboard", "dashboard.html")
PHASES = ["received", "tokenizing", "prefix_matching", "prefill_waiting", "prefill_scheduled",
          "prefilling", "decode_waiting", "decode_scheduled", "decoding", "completed"]
BOUNDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
# Hostile on purpose: the page must show it as text, never as markup.
HOSTILE = "</script><b>x"
EXPERT_ENGINES = {"d0", "d1"}


class Fake:
    def __init__(self):
        self.lock = threading.Lock()
        self.rng = random.Random(7)
        self.tick = 0
        self.t0 = 1764766000000
        self.requests = 0
        self.by_status = {"200": 0, "429": 0, "503": 0}
        self.by_class = {"interactive": 0, "batch": 0}
        self.reuse = {"requests": 0, "prompt_tokens": 0, "available": 0, "chosen": 0, "delivered": 0}
        self.hists = {name: [0] * (len(BOUNDS) + 1) for name in ("ttft", "tpot", "itl", "e2e")}
        self.sums = {name: 0.0 for name in self.hists}
        self.recent = []
        self.expert_hits = {}

    def observe(self, name, value):
        for i, bound in enumerate(BOUNDS):
            if value <= bound:
                self.hists[name][i] += 1
        self.hists[name][-1] += 1
        self.sums[name] += value

    def add_request(self, now_ms):
        rng = self.rng
        self.requests += 1
        status = rng.choices([200, 429, 503], [0.9, 0.07, 0.03])[0]
        self.by_status[str(status)] += 1
        cls = rng.choice(["interactive", "batch"])
        self.by_class[cls] += 1
        ttft = rng.lognormvariate(math.log(0.15 if cls == "interactive" else 0.6), 0.5)
        tpot = rng.lognormvariate(math.log(0.02), 0.3)
        out = rng.randint(5, 60)
        e2e = ttft + tpot * out
        self.observe("ttft", ttft)
        self.observe("tpot", tpot)
        self.observe("e2e", e2e)
        for _ in range(3):
            self.observe("itl", rng.lognormvariate(math.log(0.02), 0.5))
        prompt = rng.randint(100, 2000)
        avail = rng.randint(0, prompt)
        chosen = rng.randint(0, avail)
        delivered = max(0, chosen - rng.randint(0, 32))
        for key, value in (("requests", 1), ("prompt_tokens", prompt), ("available", avail),
                           ("chosen", chosen), ("delivered", delivered)):
            self.reuse[key] += value
        # Phase offsets that add up to ttft before decoding, then decoding to e2e.
        cuts = sorted(rng.uniform(0, ttft) for _ in range(6))
        offsets = [0.0] + cuts + [ttft, ttft + 0.001, e2e]
        reached = len(PHASES) if status == 200 else rng.randint(2, 6)
        entry = {
            "time_unix_ms": now_ms, "request_id": "req-%05d" % self.requests, "status": status,
            "path": "/v1/completions", "mode": "parallel", "stream": True, "attempts": 1,
            "prompt_tokens": prompt, "phases": dict(zip(PHASES[:reached], offsets[:reached])),
            "e2e_seconds": e2e if status == 200 else offsets[reached - 1] + 0.01,
            "prefill": rng.choice(["p0", "p1"]), "decode": rng.choice(["d0", "d1", HOSTILE]),
            "priority_class": cls,
        }
        if status == 200:
            entry.update(ttft_seconds=ttft, output_events=out, completion_tokens=out,
                         prefix_reuse={"available": avail, "chosen": chosen,
                                       "delivered": delivered if rng.random() < 0.8 else -1})
        else:
            entry["error"] = "<img src=x onerror=alert(1)> upstream said no"
        self.recent.append(entry)
        del self.recent[:-200]

    def state(self):
        with self.lock:
            self.tick += 1
            now = self.t0 + self.tick * 1000
            for _ in range(self.rng.randint(3, 12)):
                self.add_request(now)
            wave = (math.sin(self.tick / 3) + 1) / 2
            endpoints = [
                self.endpoint("p0", "prefill", 0, 8101, load=(2, 0, int(900 - 600 * wave), 1024, 300)),
                self.endpoint("p1", "prefill", 0, 8102, healthy=False),
                self.endpoint("d0", "decode", 0, 8201, load=(12, 1, 80, 1024, 0)),
                self.endpoint("d1", "decode", 1, 8202, load=(9, 0, int(400 * wave), 1024, 0)),
                self.endpoint(HOSTILE, "decode", 1, 8203, draining=True),
            ]
            hists = {name: {"bounds": BOUNDS, "cumulative": list(cum), "sum": self.sums[name],
                            "count": cum[-1]} for name, cum in self.hists.items()}
            return {
                "time_unix_ms": now, "mode": "parallel", "policy": "tandem",
                "waiting": self.rng.randint(0, 5), "running": self.rng.randint(5, 20),
                "endpoints": endpoints, "recent": list(self.recent),
                "totals": {"requests": self.requests, "by_status": dict(self.by_status),
                           "prefix_reuse": dict(self.reuse), "by_class": dict(self.by_class)},
                "histograms": hists,
            }

    def endpoint(self, name, pool, group, port, healthy=True, draining=False, load=None):
        e = {"name": name, "pool": pool, "host": "127.0.0.1", "port": port, "group": group,
             "healthy": healthy, "draining": draining, "in_flight": self.rng.randint(0, 20),
             "max_in_flight": 64, "consecutive_failures": 0 if healthy else 3,
             "load_source": "reports" if load else "gateway", "prefix_blocks": 120,
             "uncached_tokens_in_flight": self.rng.randint(0, 4000)}
        if load:
            running, waiting, free, total, prefill = load
            e["load"] = {"running": running, "waiting": waiting, "free_blocks": free,
                         "total_blocks": total, "prefill_tokens": prefill, "age_ms": 120,
                         "batch_observations": 40}
            e["reuse"] = {"requests": self.tick * 5, "prompt_tokens": self.tick * 5000,
                          "delivered": self.tick * 2100}
        return e

    def expert_load(self, name):
        with self.lock:
            self.expert_hits[name] = self.expert_hits.get(name, 0) + 1
            if name not in EXPERT_ENGINES:
                return None
            layers, experts = 24, 64
            hot = (self.tick // 5) % experts
            window = [[self.rng.randint(0, 50) + (400 if (x + layer) % experts == hot else 0)
                       for x in range(experts)] for layer in range(layers)]
            return {"layers": layers, "experts": experts, "layer_ids": list(range(layers)),
                    "window": window, "imbalance": 1.8}


def make_handler(fake, key):
    class Handler(BaseHTTPRequestHandler):
        def send(self, code, body, ctype="application/json"):
            data = body.encode() if isinstance(body, str) else body
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            url = urlparse(self.path)
            if url.path == "/fake/hits":
                return self.send(200, json.dumps(fake.expert_hits))
            if url.path.startswith("/dashboard/") and key and \
                    self.headers.get("Authorization") != "Bearer " + key:
                return self.send(401, '{"error":"admin key required"}')
            if url.path == "/dashboard":
                with open(PAGE, "rb") as f:
                    return self.send(200, f.read(), "text/html; charset=utf-8")
            if url.path == "/dashboard/state":
                return self.send(200, json.dumps(fake.state()))
            if url.path == "/dashboard/expert_load":
                name = parse_qs(url.query).get("endpoint", [""])[0]
                body = fake.expert_load(name)
                if body is None:
                    return self.send(404, '{"error":"no expert load for this engine"}')
                return self.send(200, json.dumps(body))
            self.send(404, '{"error":"not found"}')

        def log_message(self, *args):
            pass  # keep test output quiet

    return Handler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--key", default="")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(Fake(), args.key))
    print("port", server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
