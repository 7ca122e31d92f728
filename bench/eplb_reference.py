#!/usr/bin/python3
"""Runs DeepSeek's own eplb.py (kept outside this repository) on the load sets and shapes that
tandem-bench-placement wrote, for bench/placement.sh.

Usage: eplb_reference.py EPLB_DIR CASES_JSON OUT_JSON
  EPLB_DIR:   a checkout of github.com/deepseek-ai/EPLB (holds eplb.py)
  CASES_JSON: {"cases": [{"name", "loads" (.npy [layers, experts] int64), "replicas", "groups",
               "nodes", "gpus"}]}
  OUT_JSON:   {"cases": [{"name", "seconds" (median of REPEATS runs, default 1), "phy2log"}]}
Needs PyTorch (Debian's python3-torch); NumPy is not needed (the .npy reader is below).
"""
import json
import os
import statistics
import struct
import sys
import time


def read_npy_int64(path):
    with open(path, "rb") as f:
        data = f.read()
    if data[:6] != b"\x93NUMPY":
        raise SystemExit(f"{path}: not an .npy file")
    major = data[6]
    if major == 1:
        (hlen,), start = struct.unpack("<H", data[8:10]), 10
    else:
        (hlen,), start = struct.unpack("<I", data[8:12]), 12
    header = data[start:start + hlen].decode("latin1")
    if "'<i8'" not in header:
        raise SystemExit(f"{path}: want an <i8 array, header {header!r}")
    shape = tuple(int(x) for x in header.split("'shape': (")[1].split(")")[0].split(",") if x.strip())
    body = data[start + hlen:]
    values = struct.unpack(f"<{len(body) // 8}q", body)
    rows, cols = shape
    return [list(values[r * cols:(r + 1) * cols]) for r in range(rows)]


def main():
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    eplb_dir, cases_path, out_path = sys.argv[1:]
    sys.path.insert(0, eplb_dir)
    import torch  # noqa: E402
    import eplb  # noqa: E402

    torch.set_num_threads(1)
    repeats = int(os.environ.get("REPEATS", "1"))
    with open(cases_path) as f:
        cases = json.load(f)["cases"]
    out = []
    for case in cases:
        weight = torch.tensor(read_npy_int64(case["loads"]), dtype=torch.int64)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            phy2log, _, _ = eplb.rebalance_experts(weight, case["replicas"], case["groups"],
                                                   case["nodes"], case["gpus"])
            times.append(time.perf_counter() - t)
        out.append({"name": case["name"], "seconds": statistics.median(times),
                    "phy2log": phy2log.tolist()})
        print(f"eplb.py {case['name']}: {statistics.median(times) * 1e3:.1f} ms", file=sys.stderr)
    with open(out_path, "w") as f:
        json.dump({"torch": torch.__version__, "cases": out}, f)


if __name__ == "__main__":
    main()
