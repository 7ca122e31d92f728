#!/usr/bin/env bash
# Gateway overhead benchmark: `tandem gateway` next to nginx, both proxying to the same backend on
# loopback, in one run. The backend (BACKEND) is by default a second nginx answering every
# completion with a fixed reply, so neither proxy benefits from a backend of its own project;
# BACKEND=fast uses bench/fast_backend.cpp (Tandem's HTTP server) instead. wrk drives each target with the same
# POST /v1/completions body, non-streaming and streaming; the script reports each proxy's CPU time
# per request (utime+stime from /proc, all its threads and processes) and the latency it adds to
# the direct-to-backend p50/p99.
#
# Usage: bench/gateway_overhead.sh [BUILD_DIR]
# Environment: BACKEND (nginx or fast), CONNS (16), DURATION (5s per row), ROUNDS (3),
#              TOKENS (16 SSE events per stream), STREAMS ("false true": the rows to run),
#              JOBS (ninja -j, 1),
#              PIN (0: no pinning; 1: proxy alone on CPU 1, wrk and backend on CPU 0).
#              TOKENIZER_MODEL (BUILD_DIR/models/tiny-v3, for the gateway + tokenizer row, which
#              runs once `tandem gateway` takes --model).
# Each round runs the direct, nginx and gateway rows back to back, and the rounds alternate, so
# slow spells of a shared VM hit both proxies alike; the ratio reported is the median of the
# rounds' ratios (each round's rows are printed too).
# It configures BUILD_DIR with -DTANDEM_BUILD_BENCH=ON and builds `tandem` and the backend.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
conns="${CONNS:-16}"
duration="${DURATION:-5s}"
rounds="${ROUNDS:-3}"
tokens="${TOKENS:-16}"
pin="${PIN:-0}"
backend_kind="${BACKEND:-nginx}"
case "$backend_kind" in nginx | fast) ;; *) echo "BACKEND must be nginx or fast" >&2; exit 2 ;; esac
nginx_bin="${NGINX:-/usr/sbin/nginx}"

for tool in wrk "$nginx_bin" taskset; do
  command -v "$tool" >/dev/null || { echo "missing: $tool" >&2; exit 1; }
done

if [ -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -DTANDEM_BUILD_BENCH=ON >/dev/null
else
  cmake -S "$root" -B "$build" -G Ninja -DTANDEM_BUILD_BENCH=ON >/dev/null
fi
nice -n 19 cmake --build "$build" --target tandem tandem-bench-fast-backend -j "${JOBS:-1}" \
  >/dev/null

dir="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT

# With two cores no process can have a core of its own. Default: no pinning; the scheduler spreads
# wrk, the backend and the proxy over both cores. PIN=1 gives the proxy CPU 1 alone and puts wrk
# and the backend on CPU 0 (the direct rows then run on CPU 0 only): on this 2-core VM that made
# wrk + backend the bottleneck and halved nginx's request rate, without changing CPU per request.
# CPU per request is the figure to compare; request rates and latencies depend on the pinning.
cpu_client=""
cpu_proxy=""
if [ "$pin" = 1 ] && [ "$(nproc)" -ge 2 ]; then
  cpu_client="taskset -c 0"
  cpu_proxy="taskset -c 1"
fi

wait_port() {  # wait_port LOG PID: prints the port of the first "listening on http://H:P" line
  local port
  for _ in $(seq 1 300); do
    port="$(sed -n 's/.*listening on http:\/\/[^:]*:\([0-9]*\).*/\1/p' "$1" | head -1)"
    [ -n "$port" ] && { echo "$port"; return; }
    kill -0 "$2" 2>/dev/null || break
    sleep 0.1
  done
  echo "did not start; its log:" >&2
  cat "$1" >&2
  exit 1
}

# CPU ticks (utime+stime) of a process and its children (nginx's master and worker).
ticks() {
  local total=0 p
  for p in "$@" $(pgrep -P "$1" || true); do
    total=$((total + $(awk '{print $14 + $15}' "/proc/$p/stat")))
  done
  echo "$total"
}
hz="$(getconf CLK_TCK)"

# nginx_conf DIR HTTP_BODY: an nginx.conf for one worker with its files under DIR, no access log,
# and HTTP_BODY inside its http block.
nginx_conf() {
  cat >"$1/nginx.conf" <<EOF
daemon off;
worker_processes 1;
error_log stderr;
pid $1/nginx.pid;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $1/body;
  proxy_temp_path $1/proxy;
  fastcgi_temp_path $1/fastcgi;
  uwsgi_temp_path $1/uwsgi;
  scgi_temp_path $1/scgi;
  keepalive_requests 1000000;
$2
}
EOF
}

# --- the backend ------------------------------------------------------------------------------
# The same answers either way: a completion of TOKENS tokens, or with ?stream=1 TOKENS SSE chunks
# and [DONE] (the stream rows ask for that path: nginx does not read the body).
completion_json() {  # the non-streaming answer
  local text="" i
  for i in $(seq 1 "$tokens"); do text+=" tok"; done
  printf '{"id":"cmpl-bench0000000000000000","object":"text_completion","created":0,'
  printf '"model":"bench","choices":[{"index":0,"text":"%s","logprobs":null,' "$text"
  printf '"finish_reason":"length"}],"usage":{"prompt_tokens":8,"completion_tokens":%d,' "$tokens"
  printf '"total_tokens":%d}}' $((8 + tokens))
}
sse_body() {  # the streaming answer, with \n escapes for an nginx string
  local i finish
  for i in $(seq 1 "$tokens"); do
    finish=null
    [ "$i" = "$tokens" ] && finish='"length"'
    printf 'data: {"id":"cmpl-bench0000000000000000","object":"text_completion","created":0,'
    printf '"model":"bench","choices":[{"index":0,"text":" tok","logprobs":null,'
    printf '"finish_reason":%s}]}\\n\\n' "$finish"
  done
  printf 'data: [DONE]\\n\\n'
}
if [ "$backend_kind" = nginx ]; then
  mkdir -p "$dir/backend"
  backend_port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')"
  # The SSE string is double-quoted for nginx: escape its quotes.
  sse="$(sse_body | sed 's/"/\\"/g')"
  nginx_conf "$dir/backend" "  server {
    listen 127.0.0.1:$backend_port;
    location / {
      if (\$arg_stream) { rewrite ^ /sse last; }
      default_type application/json;
      return 200 '$(completion_json)';
    }
    location = /sse {
      internal;
      default_type text/event-stream;
      return 200 \"$sse\";
    }
  }"
  # shellcheck disable=SC2086
  $cpu_client "$nginx_bin" -p "$dir/backend" -c "$dir/backend/nginx.conf" >"$dir/backend.log" 2>&1 &
  backend_pid=$!
  pids+=("$backend_pid")
  for _ in $(seq 1 100); do
    curl -sf "http://127.0.0.1:$backend_port/health" >/dev/null 2>&1 && break
    kill -0 "$backend_pid" 2>/dev/null || { cat "$dir/backend.log" >&2; exit 1; }
    sleep 0.1
  done
  backend_desc="nginx fixed replies, 1 worker"
else
  # shellcheck disable=SC2086
  $cpu_client "$build/bench/tandem-bench-fast-backend" --port 0 --threads 1 --tokens "$tokens" \
    >"$dir/backend.log" 2>&1 &
  backend_pid=$!
  pids+=("$backend_pid")
  backend_port="$(wait_port "$dir/backend.log" "$backend_pid")"
  backend_desc="tandem-bench-fast-backend, 1 io thread"
fi

# --- nginx: one worker, keep-alive upstream, unbuffered so streams flow ----------------------
mkdir -p "$dir/nginx"
nginx_conf "$dir/nginx" "  upstream backend {
    server 127.0.0.1:$backend_port;
    keepalive 64;
  }
  server {
    listen 127.0.0.1:0;
    location / {
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection \"\";
      proxy_buffering off;
    }
  }"
# nginx cannot listen on port 0 and report it: pick a free port first.
nginx_port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')"
sed -i "s/listen 127.0.0.1:0;/listen 127.0.0.1:$nginx_port;/" "$dir/nginx/nginx.conf"
# shellcheck disable=SC2086
$cpu_proxy "$nginx_bin" -p "$dir/nginx" -c "$dir/nginx/nginx.conf" >"$dir/nginx.log" 2>&1 &
nginx_pid=$!
pids+=("$nginx_pid")
for _ in $(seq 1 100); do
  curl -sf "http://127.0.0.1:$nginx_port/health" >/dev/null 2>&1 && break
  kill -0 "$nginx_pid" 2>/dev/null || { cat "$dir/nginx.log" >&2; exit 1; }
  sleep 0.1
done

# --- the gateway(s) --------------------------------------------------------------------------
start_gateway() {  # start_gateway NAME EXTRA_ARGS...: sets gw_pid and gw_port
  local name="$1"
  shift
  # shellcheck disable=SC2086
  $cpu_proxy "$build/tandem" gateway --mode aggregated --decode "127.0.0.1:$backend_port" \
    --host 127.0.0.1 --port 0 --http-threads 1 "$@" >"$dir/$name.log" 2>&1 &
  gw_pid=$!
  pids+=("$gw_pid")
  gw_port="$(wait_port "$dir/$name.log" "$gw_pid")"
}
start_gateway gateway
gateway_pid=$gw_pid
gateway_port=$gw_port
tok_pid=""
if "$build/tandem" gateway --help 2>&1 | grep -q -- '--model'; then
  model="${TOKENIZER_MODEL:-$build/models/tiny-v3}"
  [ -f "$model/config.json" ] ||
    "$build/tandem" make-model --preset tiny-v3 --out "$model" >/dev/null
  start_gateway gateway-tok --model "$model"
  tok_pid=$gw_pid
  tok_port=$gw_port
fi

# --- wrk scripts: the same body through every target -----------------------------------------
prompt="You are a helpful assistant. Summarise the following paragraph in one sentence. \
The gateway receives OpenAI requests, chooses an engine, relays the answer as it streams, \
and must stay out of the way: what it costs per request is what this benchmark measures, \
next to a plain reverse proxy."
for stream in false true; do
  path="/v1/completions"
  [ "$stream" = true ] && path="/v1/completions?stream=1"
  cat >"$dir/stream-$stream.lua" <<EOF
wrk.method = "POST"
wrk.path = "$path"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"bench","prompt":"$prompt","max_tokens":$tokens,"temperature":0,'
  .. '"stream":$stream}'
EOF
done

# Latency "1.23ms" / "456.00us" / "1.02s" -> microseconds.
to_us() {
  awk -v v="$1" 'BEGIN {
    n = v + 0; u = v; sub(/^[0-9.]+/, "", u);
    if (u == "us") f = 1; else if (u == "ms") f = 1000; else if (u == "s") f = 1e6;
    else if (u == "m") f = 6e7; else f = 0;
    printf "%.0f", n * f }'
}

# run_row NAME PORT STREAM PROXY_PID: runs wrk once; prints "requests rps p50_us p99_us cpu_us".
run_row() {
  local name="$1" port="$2" stream="$3" proxy="$4" out before after backend_before backend_after
  # A short warm-up (connections, allocator pools) that is not counted.
  # shellcheck disable=SC2086
  $cpu_client wrk -t1 -c"$conns" -d1s -s "$dir/stream-$stream.lua" \
    "http://127.0.0.1:$port/v1/completions" >/dev/null
  before=0
  [ -n "$proxy" ] && before="$(ticks "$proxy")"
  backend_before="$(ticks "$backend_pid")"
  # shellcheck disable=SC2086
  out="$($cpu_client wrk -t1 -c"$conns" -d"$duration" --latency -s "$dir/stream-$stream.lua" \
    "http://127.0.0.1:$port/v1/completions")"
  after=0
  [ -n "$proxy" ] && after="$(ticks "$proxy")"
  backend_after="$(ticks "$backend_pid")"
  echo "$out" >"$dir/wrk-$name-$stream.txt"
  if grep -q -e 'Non-2xx' -e 'Socket errors' <<<"$out"; then
    echo "$name stream=$stream: wrk saw errors:" >&2
    echo "$out" >&2
    exit 1
  fi
  local requests rps p50 p99
  requests="$(awk '/requests in/ {print $1}' <<<"$out")"
  rps="$(awk '/Requests\/sec/ {print $2}' <<<"$out")"
  p50="$(to_us "$(awk '$1 == "50%" {print $2}' <<<"$out")")"
  p99="$(to_us "$(awk '$1 == "99%" {print $2}' <<<"$out")")"
  awk -v r="$requests" -v rps="$rps" -v p50="$p50" -v p99="$p99" -v t=$((after - before)) \
    -v bt=$((backend_after - backend_before)) -v hz="$hz" \
    'BEGIN { printf "%d %.0f %d %d %.1f %.1f\n", r, rps, p50, p99, t * 1e6 / hz / r,
             bt * 1e6 / hz / r }'
}

echo "backend :$backend_port ($backend_desc, $tokens tokens), nginx" \
  ":$nginx_port ($("$nginx_bin" -v 2>&1 | sed 's/.*nginx\///'), 1 worker), gateway :$gateway_port" \
  "(--http-threads 1: decisions on its io thread); wrk -t1 -c$conns -d$duration; pinning: $([ -n "$cpu_proxy" ] &&
    echo 'proxy on CPU 1, wrk + backend on CPU 0' || echo none)"
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{v[NR] = $1} END {
  print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
for stream in ${STREAMS:-false true}; do
  echo
  echo "== POST /v1/completions, stream $stream"
  printf "%-5s %-20s %9s %9s %9s %9s %11s %11s %12s %9s\n" round target requests req/s p50_us \
    p99_us added_p50 added_p99 proxy_cpu_us backend_us
  rows=("nginx $nginx_port $nginx_pid" "gateway $gateway_port $gateway_pid")
  [ -n "$tok_pid" ] && rows+=("gateway+tokenizer $tok_port $tok_pid")
  ratios=""
  tok_costs=""
  declare -A added=()  # added p50 per proxy, by round
  for round in $(seq 1 "$rounds"); do
    read -r dn drps d50 d99 _ dbk <<<"$(run_row direct "$backend_port" "$stream" "")"
    printf "%-5s %-20s %9s %9s %9s %9s %11s %11s %12s %9s\n" "$round" direct "$dn" "$drps" \
      "$d50" "$d99" - - - "$dbk"
    declare -A cpu=()
    for row in "${rows[@]}"; do
      read -r name port pid <<<"$row"
      read -r n rps p50 p99 c bk <<<"$(run_row "$name" "$port" "$stream" "$pid")"
      cpu[$name]="$c"
      added[$name]+=" $((p50 - d50))"
      printf "%-5s %-20s %9s %9s %9s %9s %11s %11s %12s %9s\n" "$round" "$name" "$n" "$rps" \
        "$p50" "$p99" $((p50 - d50)) $((p99 - d99)) "$c" "$bk"
    done
    ratios+=" $(awk -v g="${cpu[gateway]}" -v n="${cpu[nginx]}" 'BEGIN { printf "%.3f", g / n }')"
    [ -n "$tok_pid" ] && tok_costs+=" $(awk -v t="${cpu[gateway+tokenizer]}" \
      -v g="${cpu[gateway]}" 'BEGIN { printf "%.1f", t - g }')"
  done
  printf "gateway / nginx CPU per request by round:%s; median %.2fx (target <= 1.2x)\n" \
    "$ratios" "$(median <<<"$ratios")"
  printf "added p50 latency, median of the rounds (us): nginx %s, gateway %s (target: gateway <= nginx)\n" \
    "$(median <<<"${added[nginx]}")" "$(median <<<"${added[gateway]}")"
  if [ -n "$tok_pid" ]; then
    printf "tokenization adds, by round (us CPU per request):%s; median %.1f\n" "$tok_costs" \
      "$(median <<<"$tok_costs")"
  fi
done
