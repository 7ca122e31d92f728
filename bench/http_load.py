"""Raw HTTP/1.1 client pieces the load scripts share (bench/connection_load.py,
bench/chaos_load.py): requests written by hand, responses read with Content-Length or chunked
framing, OpenAI error bodies recognised, and a gateway's resident memory read from /proc."""
import asyncio
import json


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def read_response(reader, timeout):
    """One HTTP/1.1 response: (status, body). Content-Length or chunked bodies."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    fields = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            fields[k.strip().lower()] = v.strip()
    if "content-length" in fields:
        body = await asyncio.wait_for(reader.readexactly(int(fields["content-length"])), timeout)
        return status, body
    if fields.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout)
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout)
                return status, body
            body += await asyncio.wait_for(reader.readexactly(size + 2), timeout)
            body = body[:-2]
    return status, b""


def request_bytes(method, path, body=None):
    head = f"{method} {path} HTTP/1.1\r\nHost: gateway\r\n"
    if body is None:
        return (head + "\r\n").encode()
    data = json.dumps(body).encode()
    return (head + f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


def is_openai_error(body):
    try:
        e = json.loads(body)["error"]
        return isinstance(e["message"], str) and "type" in e
    except Exception:
        return False


async def stream(host, port, max_tokens, timeout):
    """(outcome, detail): 'done' (data: [DONE] and the chunked end), 'error' (an OpenAI error,
    whole or as the stream's last event, before its [DONE] if any; detail: the status and the
    start of its message), 'cut' (neither) or 'hung' (no end within
    `timeout` seconds of silence)."""
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection(host, port), 30)
        w.write(request_bytes("POST", "/v1/completions",
                              {"prompt": "Tell me a story", "max_tokens": max_tokens,
                               "stream": True, "ignore_eos": True}))
        status, body = await read_response(r, timeout)
        w.close()
        if status != 200:
            return ("error", error_detail(status, body)) if is_openai_error(body) else ("cut", "")
        events = [e for e in body.decode().split("\n\n") if e.startswith("data: ")]
        # A failed stream ends with an OpenAI error event and then [DONE], as vLLM ends it.
        if events and events[-1] == "data: [DONE]":
            events.pop()
            if events and is_openai_error(events[-1][6:]):
                return "error", error_detail(200, events[-1][6:])
            return "done", ""
        if events and is_openai_error(events[-1][6:]):
            return "error", error_detail(200, events[-1][6:])
        return "cut", ""
    except asyncio.TimeoutError:
        return "hung", ""
    except Exception as e:
        return "cut", type(e).__name__


def error_detail(status, body):
    """The status and the message's first words, with digits blanked, for counting."""
    message = json.loads(body)["error"]["message"]
    words = " ".join(message.split()[:7])
    return f"{status} " + "".join("#" if c.isdigit() else c for c in words)
