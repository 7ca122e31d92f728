#!/usr/bin/python3
"""Independent reader of a Hugging Face safetensors checkpoint folder, written from the format's
published description (not from Tandem's code). It validates what a strict reader and the
Hugging Face tooling expect and prints, as JSON, every tensor's dtype, shape, file, decoded
values (small tensors) and a float64 sum of all values.

usage: safetensors_check.py DIR [--values-limit N]

Checks:
  * one model.safetensors, or model-XXXXX-of-YYYYY.safetensors shards named by
    model.safetensors.index.json, whose weight_map covers exactly the shards' tensors and whose
    metadata.total_size is the sum of the tensors' byte sizes;
  * per file: u64 little-endian header length, a JSON object header padded with spaces to a
    multiple of 8 bytes, "__metadata__" == {"format": "pt"}, known dtypes, byte sizes that match
    shapes, data that covers the data section without gaps or overlaps, and every tensor's data
    naturally aligned in the file.
Exit status 1 with a message on stderr when any check fails.
"""
import json
import math
import os
import re
import struct
import sys

import numpy as np

SIZES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I8": 1}


def fail(msg):
    sys.stderr.write("safetensors_check: " + msg + "\n")
    sys.exit(1)


def e4m3_table():
    # OCP FP8 E4M3 ("fn"): bias 7, no infinities, S.1111.111 is NaN.
    table = np.zeros(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> 3) & 0xF
        mant = code & 0x7
        if exp == 0xF and mant == 0x7:
            table[code] = math.nan
        elif exp == 0:
            table[code] = sign * mant / 8.0 * 2.0 ** -6
        else:
            table[code] = sign * (1.0 + mant / 8.0) * 2.0 ** (exp - 7)
    return table


E4M3 = e4m3_table()


def decode(dtype, raw):
    if dtype == "F32":
        return np.frombuffer(raw, dtype="<f4").astype(np.float64)
    if dtype == "F16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float64)
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    if dtype == "I8":
        return np.frombuffer(raw, dtype=np.int8).astype(np.float64)
    if dtype == "F8_E4M3":
        return E4M3[np.frombuffer(raw, dtype=np.uint8)]
    fail("unknown dtype " + dtype)


def read_file(path, values_limit):
    with open(path, "rb") as f:
        blob = f.read()
    name = os.path.basename(path)
    if len(blob) < 8:
        fail(f"{name}: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        fail(f"{name}: header length {n} beyond the file")
    header_bytes = blob[8:8 + n]
    if n % 8 != 0:
        fail(f"{name}: header length {n} is not a multiple of 8")
    text = header_bytes.decode("utf-8")
    stripped = text.rstrip(" ")
    if not stripped.endswith("}") or len(text) - len(stripped) >= 8:
        fail(f"{name}: header padding is not 0-7 trailing spaces")
    header = json.loads(text)
    if header.get("__metadata__") != {"format": "pt"}:
        fail(f"{name}: __metadata__ is {header.get('__metadata__')!r}, expected {{'format': 'pt'}}")
    data = blob[8 + n:]
    spans = []
    out = {}
    for tname, entry in header.items():
        if tname == "__metadata__":
            continue
        if set(entry) != {"dtype", "shape", "data_offsets"}:
            fail(f"{name}: {tname}: fields {sorted(entry)}")
        dtype = entry["dtype"]
        if dtype not in SIZES:
            fail(f"{name}: {tname}: dtype {dtype}")
        begin, end = entry["data_offsets"]
        numel = 1
        for d in entry["shape"]:
            numel *= d
        if end - begin != numel * SIZES[dtype]:
            fail(f"{name}: {tname}: {end - begin} bytes for shape {entry['shape']} {dtype}")
        if (8 + n + begin) % SIZES[dtype] != 0:
            fail(f"{name}: {tname}: data at file offset {8 + n + begin} is not aligned to {SIZES[dtype]}")
        spans.append((begin, end, tname))
        values = decode(dtype, data[begin:end])
        rec = {"dtype": dtype, "shape": entry["shape"], "file": name, "nbytes": end - begin,
               "sum": float(np.nansum(values))}
        if numel <= values_limit:
            rec["values"] = [None if math.isnan(v) else float(v) for v in values]
        out[tname] = rec
    spans.sort()
    pos = 0
    for begin, end, tname in spans:
        if begin != pos:
            fail(f"{name}: {tname} starts at {begin}, previous data ended at {pos}")
        pos = end
    if pos != len(data):
        fail(f"{name}: data section is {len(data)} bytes, tensors cover {pos}")
    return out


def main():
    args = sys.argv[1:]
    limit = 4096
    if "--values-limit" in args:
        i = args.index("--values-limit")
        limit = int(args[i + 1])
        del args[i:i + 2]
    folder = args[0]
    index_path = os.path.join(folder, "model.safetensors.index.json")
    tensors = {}
    result = {"index": None}
    if os.path.exists(index_path):
        with open(index_path) as f:
            index_text = f.read()
        index = json.loads(index_text)
        if set(index) != {"metadata", "weight_map"}:
            fail(f"index keys {sorted(index)}")
        weight_map = index["weight_map"]
        if list(weight_map) != sorted(weight_map):
            fail("index weight_map keys are not sorted")
        if index_text != json.dumps(index, indent=2, sort_keys=True) + "\n":
            fail("index is not formatted as json.dumps(indent=2, sort_keys=True) + newline")
        files = sorted(set(weight_map.values()))
        count = len(files)
        for k, file in enumerate(files):
            expected = f"model-{k + 1:05d}-of-{count:05d}.safetensors"
            if file != expected:
                fail(f"shard {k + 1} is named {file}, expected {expected}")
            for tname, rec in read_file(os.path.join(folder, file), limit).items():
                if weight_map.get(tname) != file:
                    fail(f"{file} holds {tname}, which the index maps to {weight_map.get(tname)}")
                tensors[tname] = rec
        if set(tensors) != set(weight_map):
            fail("index lists tensors missing from the shards: " +
                 ", ".join(sorted(set(weight_map) - set(tensors))[:5]))
        total = sum(r["nbytes"] for r in tensors.values())
        if index["metadata"] != {"total_size": total}:
            fail(f"index metadata {index['metadata']}, expected total_size {total}")
        result["index"] = {"files": files, "total_size": total}
    else:
        tensors = read_file(os.path.join(folder, "model.safetensors"), limit)
    result["tensors"] = tensors
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
