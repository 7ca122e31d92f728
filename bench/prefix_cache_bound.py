#!/usr/bin/env python3
"""How much of a Mooncake trace window's prompts a prefix cache can serve, under three models:

1. the trace's own bound: one infinite cache keyed by the trace's 512-token hash ids (what
   bench/policy_comparison.sh prints as bound_%);
2. the same at an engine's granularity: one infinite cache of 16-token blocks of the prompts
   `tandem bench` generates (block k of the prompt is hash id k's 512 tokens, the last block
   truncated), never the prompt's last token (an engine always computes it);
3. N engines, each an LRU cache of C 16-token blocks, every request routed to the engine where
   queued work plus its own uncached tokens is least (cache-aware and balanced, with no timing:
   an idealised router on finite caches).

The gap between 1 and 3 is what finite KV capacity costs any policy, before queueing and timing.

Usage: bench/prefix_cache_bound.py TRACE [START] [LIMIT] [ENGINES] [BLOCKS_PER_ENGINE]
       (defaults 0, 300, 4, 32768: the simulated H800's KV, 524,288 tokens per engine)
"""
import json
import sys
from collections import OrderedDict

BLOCK = 16
HASH_BLOCK = 512


def block_keys(record):
    """Chained keys of the 16-token blocks of the prompt `tandem bench` builds for a record."""
    keys, prev, n = [], None, record["input_length"]
    for i, h in enumerate(record["hash_ids"]):
        for sub in range(HASH_BLOCK // BLOCK):
            if i * HASH_BLOCK + (sub + 1) * BLOCK > n:
                return keys
            prev = hash((prev, h, sub))
            keys.append(prev)
    return keys


def leading(keys, present):
    n = 0
    for k in keys:
        if k not in present:
            break
        n += 1
    return n


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    path = args[0]
    start = int(args[1]) if len(args) > 1 else 0
    limit = int(args[2]) if len(args) > 2 else 300
    engines = int(args[3]) if len(args) > 3 else 4
    capacity = int(args[4]) if len(args) > 4 else 32768
    records = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= start + limit:
                break
            if i >= start:
                records.append(json.loads(line))
    total = sum(r["input_length"] for r in records)

    seen, hit = set(), 0
    for r in records:
        hit += min(HASH_BLOCK * leading(r["hash_ids"], seen), r["input_length"])
        seen.update(r["hash_ids"])
    print(f"trace bound (infinite cache, 512-token hash blocks): {100 * hit / total:.2f}%")

    seen, hit = set(), 0
    for r in records:
        keys = block_keys(r)
        hit += min(BLOCK * leading(keys, seen), r["input_length"] - 1)
        seen.update(keys)
    print(f"one infinite cache of 16-token blocks: {100 * hit / total:.2f}%")

    caches = [OrderedDict() for _ in range(engines)]
    work = [0] * engines
    hit = 0
    for r in records:
        keys, n = block_keys(r), r["input_length"]
        cached = [min(BLOCK * leading(keys, c), n - 1) for c in caches]
        e = min(range(engines), key=lambda i: (work[i] + n - cached[i], i))
        hit += cached[e]
        work[e] += n - cached[e]
        for k in keys:
            caches[e][k] = True
            caches[e].move_to_end(k)
        while len(caches[e]) > capacity:
            caches[e].popitem(last=False)
    print(f"{engines} engines x {capacity} blocks (LRU), idealised cache-aware balanced routing: "
          f"{100 * hit / total:.2f}%")


if __name__ == "__main__":
    main()
