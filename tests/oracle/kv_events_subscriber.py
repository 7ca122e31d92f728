#!/usr/bin/env python3
"""Independent oracle for Tandem's KV-cache events and block hash.

Run with Debian's interpreter (/usr/bin/python3), which has python3-msgpack and python3-zmq.

Decodes vLLM's KV-event wire format (array_like msgspec encoding) with the `msgpack` package,
checks its shape strictly, and prints every batch as one JSON line. It shares no code with the C++
side: the block hash is recomputed here from its documented definition (src/api/block_hash.h),
using the `xxhash` package when it is installed and otherwise the XXH3-64 implementation below,
written from the xxHash specification.

Subcommands:
  xxh3        stdin lines "<seed> <hex bytes>" -> stdout lines "<xxh3_64 as decimal>"
  blockhash   stdin lines "<block_size> <salt or -> <token ids...>" -> stdout lines of hashes
  subscribe   SUB to --endpoint, print "ready", then print batches as they arrive; fills gaps in
              the sequence numbers from --replay; exits after --batches non-empty batches;
              --drop-nonempty N ignores the N-th non-empty live batch to force a replay
  replay      ask --replay for every buffered batch from --start; print them and the end marker
"""

import argparse
import json
import struct
import sys

# ---------------------------------------------------------------------------------------------
# XXH3-64 (xxHash 0.8 specification), for machines without the `xxhash` package.

M64 = (1 << 64) - 1
P32_1, P32_2, P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
P64_1, P64_2, P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
P64_4, P64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
PRIME_MX1, PRIME_MX2 = 0x165667919E3779F9, 0x9FB21C651E98DF25

# The specification's default 192-byte secret.
K_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")


def r64(b, i):
    return int.from_bytes(b[i:i + 8], "little")


def r32(b, i):
    return int.from_bytes(b[i:i + 4], "little")


def rotl64(x, r):
    return ((x << r) | (x >> (64 - r))) & M64


def swap64(x):
    return int.from_bytes(x.to_bytes(8, "little"), "big")


def swap32(x):
    return int.from_bytes(x.to_bytes(4, "little"), "big")


def mul128_fold64(a, b):
    p = a * b
    return (p & M64) ^ (p >> 64)


def xxh64_avalanche(h):
    h ^= h >> 33
    h = (h * P64_2) & M64
    h ^= h >> 29
    h = (h * P64_3) & M64
    return h ^ (h >> 32)


def xxh3_avalanche(h):
    h ^= h >> 37
    h = (h * PRIME_MX1) & M64
    return h ^ (h >> 32)


def rrmxmx(h, n):
    h ^= rotl64(h, 49) ^ rotl64(h, 24)
    h = (h * PRIME_MX2) & M64
    h ^= (h >> 35) + n
    h = (h * PRIME_MX2) & M64
    return h ^ (h >> 28)


def mix16(d, i, s, j, seed):
    lo = r64(d, i) ^ ((r64(s, j) + seed) & M64)
    hi = r64(d, i + 8) ^ ((r64(s, j + 8) - seed) & M64)
    return mul128_fold64(lo, hi)


def xxh3_64_pure(d, seed=0):
    n, s = len(d), K_SECRET
    if n == 0:
        return xxh64_avalanche(seed ^ r64(s, 56) ^ r64(s, 64))
    if n <= 3:
        combined = (d[0] << 16) | (d[n >> 1] << 24) | d[n - 1] | (n << 8)
        return xxh64_avalanche(combined ^ (((r32(s, 0) ^ r32(s, 4)) + seed) & M64))
    if n <= 8:
        seed ^= swap32(seed & 0xFFFFFFFF) << 32
        keyed = (r32(d, n - 4) + (r32(d, 0) << 32)) ^ (((r64(s, 8) ^ r64(s, 16)) - seed) & M64)
        return rrmxmx(keyed, n)
    if n <= 16:
        lo = r64(d, 0) ^ (((r64(s, 24) ^ r64(s, 32)) + seed) & M64)
        hi = r64(d, n - 8) ^ (((r64(s, 40) ^ r64(s, 48)) - seed) & M64)
        return xxh3_avalanche((n + swap64(lo) + hi + mul128_fold64(lo, hi)) & M64)
    if n <= 128:
        acc = (n * P64_1) & M64
        pairs = [(0, 0)]
        if n > 32:
            pairs.append((16, 32))
            if n > 64:
                pairs.append((32, 64))
                if n > 96:
                    pairs.append((48, 96))
        for k, (off, sec) in enumerate(pairs):
            acc += mix16(d, off, s, sec, seed) + mix16(d, n - 16 - off, s, sec + 16, seed)
        return xxh3_avalanche(acc & M64)
    if n <= 240:
        acc = (n * P64_1) & M64
        for i in range(8):
            acc += mix16(d, 16 * i, s, 16 * i, seed)
        acc = xxh3_avalanche(acc & M64)
        for i in range(8, n // 16):
            acc += mix16(d, 16 * i, s, 16 * (i - 8) + 3, seed)
        acc += mix16(d, n - 16, s, 136 - 17, seed)
        return xxh3_avalanche(acc & M64)
    # Long inputs: a secret derived from the seed, then stripes of 64 bytes.
    secret = bytearray(192)
    for i in range(12):
        secret[16 * i:16 * i + 8] = ((r64(s, 16 * i) + seed) & M64).to_bytes(8, "little")
        secret[16 * i + 8:16 * i + 16] = ((r64(s, 16 * i + 8) - seed) & M64).to_bytes(8, "little")
    secret = bytes(secret)
    acc = [P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1]

    def stripe(off, soff):
        for i in range(8):
            v = r64(d, off + 8 * i)
            k = v ^ r64(secret, soff + 8 * i)
            acc[i ^ 1] = (acc[i ^ 1] + v) & M64
            acc[i] = (acc[i] + (k & 0xFFFFFFFF) * (k >> 32)) & M64

    stripes_per_block = (192 - 64) // 8
    block_len = 64 * stripes_per_block
    nb_blocks = (n - 1) // block_len
    for b in range(nb_blocks):
        for st in range(stripes_per_block):
            stripe(b * block_len + 64 * st, 8 * st)
        for i in range(8):
            a = acc[i]
            a ^= a >> 47
            a ^= r64(secret, 192 - 64 + 8 * i)
            acc[i] = (a * P32_1) & M64
    for st in range(((n - 1) - block_len * nb_blocks) // 64):
        stripe(nb_blocks * block_len + 64 * st, 8 * st)
    stripe(n - 64, 192 - 64 - 7)
    result = (n * P64_1) & M64
    for i in range(4):
        result += mul128_fold64(acc[2 * i] ^ r64(secret, 11 + 16 * i),
                                acc[2 * i + 1] ^ r64(secret, 11 + 16 * i + 8))
    return xxh3_avalanche(result & M64)


try:
    import xxhash  # type: ignore

    def xxh3_64(data, seed=0):
        return xxhash.xxh3_64_intdigest(data, seed=seed)

    XXH3_SOURCE = "xxhash " + xxhash.VERSION
except ImportError:
    xxh3_64 = xxh3_64_pure
    XXH3_SOURCE = "pure-python"

# ---------------------------------------------------------------------------------------------
# The block hash, from its definition in src/api/block_hash.h.

BLOCK_HASH_SEED = int.from_bytes(b"TandemKV", "big")
BLOCK_HASH_ROOT = 0


def block_hash(parent, tokens, salt=None):
    data = struct.pack("<Q", BLOCK_HASH_ROOT if parent is None else parent)
    data += struct.pack("<%di" % len(tokens), *tokens)
    if salt is not None:
        assert parent is None
        data += struct.pack("<Q", salt)
    return xxh3_64(data, BLOCK_HASH_SEED)


def block_hashes(tokens, block_size, parent=None, salt=None):
    out = []
    for i in range(len(tokens) // block_size):
        h = block_hash(parent, tokens[i * block_size:(i + 1) * block_size],
                       salt if parent is None else None)
        out.append(h)
        parent = h
    return out

# ---------------------------------------------------------------------------------------------
# Decoding vLLM's array_like event batches, strictly.


class FormatError(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise FormatError(what)


def is_u64(x):
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= M64


def decode_event(ev):
    expect(isinstance(ev, list) and ev and isinstance(ev[0], str), "event must be [tag, ...]")
    tag = ev[0]
    if tag == "BlockStored":
        expect(len(ev) == 8, "BlockStored must have 7 fields, has %d" % (len(ev) - 1))
        _, hashes, parent, tokens, block_size, lora_id, medium, lora_name = ev
        expect(isinstance(hashes, list) and all(is_u64(h) for h in hashes), "block_hashes")
        expect(parent is None or is_u64(parent), "parent_block_hash")
        expect(isinstance(tokens, list) and all(isinstance(t, int) for t in tokens), "token_ids")
        expect(isinstance(block_size, int) and block_size > 0, "block_size")
        expect(len(tokens) == len(hashes) * block_size, "len(token_ids) != blocks * block_size")
        expect(lora_id is None or isinstance(lora_id, int), "lora_id")
        expect(medium is None or isinstance(medium, str), "medium")
        expect(lora_name is None or isinstance(lora_name, str), "lora_name")
        recomputed = block_hashes(tokens, block_size, parent=parent)
        return {"type": tag, "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": tokens, "block_size": block_size, "lora_id": lora_id,
                "medium": medium, "lora_name": lora_name,
                # Without a parent the first block may carry a salt we cannot know.
                "hashes_match_tokens": recomputed == hashes}
    if tag == "BlockRemoved":
        expect(len(ev) == 3, "BlockRemoved must have 2 fields, has %d" % (len(ev) - 1))
        _, hashes, medium = ev
        expect(isinstance(hashes, list) and all(is_u64(h) for h in hashes), "block_hashes")
        expect(medium is None or isinstance(medium, str), "medium")
        return {"type": tag, "block_hashes": hashes, "medium": medium}
    if tag == "AllBlocksCleared":
        expect(len(ev) == 1, "AllBlocksCleared has no fields")
        return {"type": tag}
    raise FormatError("unknown event tag %r" % tag)


def decode_batch(payload):
    import msgpack
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    expect(isinstance(batch, list) and len(batch) in (2, 3), "batch must be [ts, events(, rank)]")
    expect(isinstance(batch[0], float), "ts must be a float")
    expect(isinstance(batch[1], list), "events must be an array")
    rank = batch[2] if len(batch) == 3 else None
    expect(rank is None or isinstance(rank, int), "data_parallel_rank must be an int")
    return {"ts": batch[0], "events": [decode_event(e) for e in batch[1]],
            "data_parallel_rank": rank}


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()

# ---------------------------------------------------------------------------------------------
# ZMQ


END_SEQ = (1 << 64) - 1  # -1 as a signed 64-bit big-endian integer


def replay_from(ctx, endpoint, start, timeout_ms):
    """Yields (seq, payload) for buffered batches >= start; stops at the end marker."""
    import zmq
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    # A DEALER sends the empty delimiter itself; the ROUTER sees [identity, "", start].
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    try:
        while True:
            if not sock.poll(timeout_ms):
                raise TimeoutError("no reply from replay endpoint %s" % endpoint)
            frames = sock.recv_multipart()
            expect(len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8,
                   "replay reply must be ['', seq(8), payload]")
            seq = int.from_bytes(frames[1], "big")
            if seq == END_SEQ:
                expect(frames[2] == b"", "end marker must carry an empty payload")
                return
            yield seq, frames[2]
    finally:
        sock.close()


def cmd_subscribe(args):
    import zmq
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    sub.connect(args.endpoint)
    emit({"ready": True})
    expected = 0  # next sequence number we need
    nonempty = 0
    live_nonempty = 0
    timeout_ms = int(args.timeout * 1000)
    while nonempty < args.batches:
        if not sub.poll(timeout_ms):
            emit({"error": "timeout waiting for batch %d" % expected})
            return 2
        topic, seq_bytes, payload = sub.recv_multipart()
        expect(topic == args.topic.encode(), "topic")
        expect(len(seq_bytes) == 8, "seq must be 8 bytes")
        seq = int.from_bytes(seq_bytes, "big")
        if seq < expected:
            continue  # already delivered through a replay
        if seq > expected:
            # Gap: fetch what we missed (and possibly more) from the replay socket.
            for rseq, rpayload in replay_from(ctx, args.replay, expected, timeout_ms):
                if rseq < expected:
                    continue
                expect(rseq == expected, "replay skipped from %d to %d" % (expected, rseq))
                batch = decode_batch(rpayload)
                emit({"seq": rseq, "via": "replay", "batch": batch})
                nonempty += bool(batch["events"])
                expected = rseq + 1
            if seq < expected:
                continue
            expect(seq == expected, "gap %d..%d not in the replay buffer" % (expected, seq))
        batch = decode_batch(payload)
        if batch["events"]:
            live_nonempty += 1
            if live_nonempty in args.drop_nonempty:
                continue  # pretend it was lost, so the next batch reveals a gap
        emit({"seq": seq, "via": "live", "batch": batch})
        nonempty += bool(batch["events"])
        expected = seq + 1
    sub.close()
    ctx.term()
    return 0


def cmd_replay(args):
    import zmq
    ctx = zmq.Context()
    for seq, payload in replay_from(ctx, args.replay, args.start, int(args.timeout * 1000)):
        emit({"seq": seq, "via": "replay", "batch": decode_batch(payload)})
    emit({"end": True})
    ctx.term()
    return 0


def cmd_xxh3(_args):
    for line in sys.stdin:
        if line.strip():
            seed, hexdata = (line.split() + [""])[:2]
            print(xxh3_64_pure(bytes.fromhex(hexdata), int(seed)))
    return 0


def cmd_blockhash(_args):
    for line in sys.stdin:
        fields = line.split()
        if not fields:
            continue
        block_size, salt = int(fields[0]), (None if fields[1] == "-" else int(fields[1]))
        tokens = [int(t) for t in fields[2:]]
        print(" ".join(str(h) for h in block_hashes(tokens, block_size, salt=salt)))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sp = p.add_subparsers(dest="cmd", required=True)
    sp.add_parser("xxh3")
    sp.add_parser("blockhash")
    s = sp.add_parser("subscribe")
    s.add_argument("--endpoint", required=True)
    s.add_argument("--replay", required=True)
    s.add_argument("--topic", default="")
    s.add_argument("--batches", type=int, required=True, help="non-empty batches to collect")
    s.add_argument("--drop-nonempty", type=int, action="append", default=[],
                   help="ignore the N-th non-empty live batch (1-based), to test gap filling")
    s.add_argument("--timeout", type=float, default=20.0)
    r = sp.add_parser("replay")
    r.add_argument("--replay", required=True)
    r.add_argument("--start", type=int, default=0)
    r.add_argument("--timeout", type=float, default=20.0)
    args = p.parse_args()
    try:
        return {"xxh3": cmd_xxh3, "blockhash": cmd_blockhash, "subscribe": cmd_subscribe,
                "replay": cmd_replay}[args.cmd](args)
    except FormatError as e:
        emit({"error": "format: %s" % e})
        return 3


if __name__ == "__main__":
    sys.exit(main())
