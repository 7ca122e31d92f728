#!/usr/bin/env bash
# Installs everything Tandem needs to build, test and benchmark on Debian bookworm.
# Idempotent: packages already present are skipped by apt; npm uses the lock file.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

debian_packages=(
  build-essential cmake ninja-build ccache pkg-config git curl
  libboost-dev libpcre2-dev libicu-dev nlohmann-json3-dev libabsl-dev libxxhash-dev
  libcli11-dev libfmt-dev libspdlog-dev libdnnl-dev libzmq3-dev cppzmq-dev libmsgpack-cxx-dev
  libgtest-dev libgmock-dev libbenchmark-dev libyaml-cpp-dev libtcmalloc-minimal4 libssl-dev
  nginx-light wrk chromium
  clang libclang-rt-dev libomp-dev  # bench/fuzz.sh: libFuzzer (clang's OpenMP for the CMake configure)
  python3 python3-jinja2 python3-numpy python3-torch python3-msgpack python3-zmq python3-prometheus-client
  python3-jsonschema  # structured outputs: answers validated against their schemas
)
# Node.js may come from Debian (nodejs + npm) or from NodeSource (nodejs alone, npm bundled).
command -v npm >/dev/null 2>&1 || debian_packages+=(nodejs npm)

missing=()
for p in "${debian_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  echo "install-deps: installing ${missing[*]}"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Test oracles (Hugging Face tokenizer files and the native tokenizers binding), pinned by the lock file.
oracle="$here/tests/oracle"
if [ ! -d "$oracle/node_modules/@anush008/tokenizers" ] || [ "$oracle/package-lock.json" -nt "$oracle/node_modules/.package-lock.json" ]; then
  echo "install-deps: npm ci in tests/oracle"
  (cd "$oracle" && npm ci --no-audit --no-fund --loglevel=error)
fi
