"""Oracle for JSON Schema string formats, patterns, lengths and integer ranges in structured outputs: judges
JSON texts by Python's own parsers. Reads on stdin
  {"checks": [{"kind": K, "texts": [JSON text, ...], ...}, ...]}
and writes [[{"valid": bool, "canonical": bool, "why": str}, ...], ...], one list per check.

"valid": the text is JSON and its value is what the kind asks for:
  date-time, date, time   a string of RFC 3339's shape (ASCII digits, 'T', 'Z' or an offset)
                          that datetime/date/time.fromisoformat read (an aware time);
  uuid, uuid1 .. uuid8    the 8-4-4-4-12 hex form that uuid.UUID reads (of that version);
  ipv4, ipv6              what ipaddress reads (for ipv6: no dotted IPv4 tail, no zone);
  email                   what email.headerregistry reads as a dot-atom addr-spec, its domain
                          LDH labels of 1 to 63 characters, two or more, the last letters only;
  uri                     RFC 3986's URI (Appendix A's ABNF, transcribed below as URI), its
                          host a reg-name (an IP-literal, "[...]", is left out), that
                          urllib.parse.urlsplit reads with the same scheme;
  uri-reference           RFC 3986's URI-reference (a URI or a relative-ref), alike;
  hostname                RFC 1123's host name: LDH labels of 1 to 63 characters, neither
                          first nor last a hyphen, joined by dots, 253 characters in all, no
                          trailing dot, and that Python's idna codec encodes;
  duration                RFC 3339's duration (Appendix A's ABNF, read by duration_ok below);
  json-pointer            RFC 6901's JSON Pointer (read by json_pointer_ok below);
  pattern                 a string that re.fullmatch(check["pattern"]) accepts, in Tandem's
                          flavour (structured_output_oracle.tandem_flavour);
  integer                 an integer (not a bool) from check["minimum"] to check["maximum"];
  number                  a number (not a bool) within check's minimum, maximum,
                          exclusiveMinimum and exclusiveMaximum (those given), compared as
                          Python compares what json.loads reads (an int exactly, a float as a
                          double), as jsonschema does.
Any kind but integer also takes check["minLength"] and check["maxLength"]: the string's length
in characters (code points, Python's len) must lie within them.
"canonical": the text is the value as json.dumps(value, ensure_ascii=False) writes it (one
spelling of each string; for integers, no '-0'), white space around it aside; for numbers, the
text is written as Tandem writes a number within bounds: no exponent, at most 16 digits before the
point and 16 after, and not a negative zero ('-0', '-0.0').
Times have at most 6 fraction digits, the microseconds Python keeps (it cuts more off silently),
which Tandem's formats write (src/structured/string_formats.cpp)."""
import ipaddress
import json
import os
import re
import sys
import uuid
from datetime import date, datetime, time
from email.errors import MessageError
from email.headerregistry import Address
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from structured_output_oracle import tandem_flavour  # noqa: E402

NUMBER_TEXT = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?"
TIME = r"\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})"
SHAPES = {
    "date": r"\d{4}-\d{2}-\d{2}",
    "time": TIME,
    "date-time": r"\d{4}-\d{2}-\d{2}T" + TIME,
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}


def domain_ok(domain):
    labels = domain.split(".")
    ldh = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
    for label in labels:
        if not 1 <= len(label) <= 63 or not set(label) <= ldh:
            return False
        if label[0] == "-" or label[-1] == "-":
            return False
    last = labels[-1]
    return len(labels) >= 2 and len(last) >= 2 and last.isascii() and last.isalpha()


# RFC 3986, Appendix A, with the IP-literal left out of host (so host is reg-name; IPv4address
# is a reg-name too).
UNRESERVED = r"[A-Za-z0-9\-._~]"
PCT = r"%[0-9A-Fa-f]{2}"
SUB_DELIMS = r"[!$&'()*+,;=]"
PCHAR = "(?:%s|%s|%s|[:@])" % (UNRESERVED, PCT, SUB_DELIMS)
SEGMENT = PCHAR + "*"
SEGMENT_NZ = PCHAR + "+"
SEGMENT_NZ_NC = "(?:%s|%s|%s|@)+" % (UNRESERVED, PCT, SUB_DELIMS)
USERINFO = "(?:%s|%s|%s|:)*" % (UNRESERVED, PCT, SUB_DELIMS)
REG_NAME = "(?:%s|%s|%s)*" % (UNRESERVED, PCT, SUB_DELIMS)
AUTHORITY = "(?:%s@)?%s(?::[0-9]*)?" % (USERINFO, REG_NAME)
PATH_ABEMPTY = "(?:/%s)*" % SEGMENT
PATH_ABSOLUTE = "/(?:%s(?:/%s)*)?" % (SEGMENT_NZ, SEGMENT)
PATH_ROOTLESS = "%s(?:/%s)*" % (SEGMENT_NZ, SEGMENT)
PATH_NOSCHEME = "%s(?:/%s)*" % (SEGMENT_NZ_NC, SEGMENT)
QUERY = "(?:%s|[/?])*" % PCHAR
SCHEME = "[A-Za-z][A-Za-z0-9+\\-.]*"
HIER_PART = "(?://%s%s|%s|%s|)" % (AUTHORITY, PATH_ABEMPTY, PATH_ABSOLUTE, PATH_ROOTLESS)
URI = "(%s):%s(?:\\?%s)?(?:#%s)?" % (SCHEME, HIER_PART, QUERY, QUERY)
RELATIVE_PART = "(?://%s%s|%s|%s|)" % (AUTHORITY, PATH_ABEMPTY, PATH_ABSOLUTE, PATH_NOSCHEME)
RELATIVE_REF = "%s(?:\\?%s)?(?:#%s)?" % (RELATIVE_PART, QUERY, QUERY)


def uri_ok(kind, v):
    m = re.fullmatch(URI, v)
    if m is None and (kind == "uri" or not re.fullmatch(RELATIVE_REF, v)):
        return "not RFC 3986's " + ("URI" if kind == "uri" else "URI-reference")
    if urlsplit(v).scheme != (m.group(1).lower() if m else ""):
        return "urlsplit reads another scheme"
    return None


def hostname_ok(v):
    labels = v.split(".")
    for label in labels:
        if not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", label):
            return "bad label %r" % label
    if len(v) > 253:
        return "longer than 253"
    v.encode("idna")
    return None


def duration_ok(v):
    """RFC 3339, Appendix A, read left to right:
    duration = "P" (dur-date / dur-time / dur-week); dur-date = (dur-day / dur-month / dur-year)
    [dur-time]; dur-year = n "Y" [dur-month]; dur-month = n "M" [dur-day]; dur-day = n "D";
    dur-time = "T" (dur-hour / dur-minute / dur-second); dur-hour = n "H" [dur-minute];
    dur-minute = n "M" [dur-second]; dur-second = n "S"; dur-week = n "W"; n = 1*DIGIT."""
    if not v.startswith("P"):
        return "no P"
    # (number, designator) pairs, the T apart.
    parts, i, in_time = [], 1, False
    while i < len(v):
        if v[i] == "T" and not in_time:
            in_time, i = True, i + 1
            parts.append("T")
            continue
        j = i
        while j < len(v) and v[j] in "0123456789":
            j += 1
        if j == i or j == len(v):
            return "a number without a designator, or a designator without a number"
        parts.append(("T" if in_time else "") + v[j])
        i = j + 1
    date_orders = [["D"], ["M"], ["M", "D"], ["Y"], ["Y", "M"], ["Y", "M", "D"]]
    time_orders = [["TH"], ["TH", "TM"], ["TH", "TM", "TS"], ["TM"], ["TM", "TS"], ["TS"]]
    if parts == ["W"]:
        return None
    date = parts[: parts.index("T")] if "T" in parts else parts
    time = parts[parts.index("T") + 1:] if "T" in parts else None
    if date and date not in date_orders:
        return "date part %s" % date
    if time is not None and time not in time_orders:
        return "time part %s" % time
    if not date and time is None:
        return "nothing after P"
    return None


def json_pointer_ok(v):
    """RFC 6901: *( "/" reference-token ), a '~' in a token only as ~0 or ~1."""
    if v == "":
        return None
    if not v.startswith("/"):
        return "does not begin with /"
    for token in v[1:].split("/"):
        # Read left to right: "~~01" is a lone ~ then ~0 and 1 (removing each ~0 and ~1 left none).
        if not re.fullmatch(r"(?:[^~]|~[01])*", token, re.DOTALL):
            return "a ~ not followed by 0 or 1 in %r" % token
    return None


def string_ok(kind, v, check):
    """Why `v` is not of `kind`, or None."""
    if kind == "pattern":
        return None if re.fullmatch(tandem_flavour(check["pattern"]), v) else "no full match"
    if kind.startswith("uuid"):
        if not re.fullmatch(SHAPES["uuid"], v, re.ASCII):
            return "not 8-4-4-4-12 hex"
        u = uuid.UUID(v)
        if kind != "uuid" and u.version != int(kind[4:]):
            return "version %s" % u.version
        return None
    if kind in SHAPES:
        if not re.fullmatch(SHAPES[kind], v, re.ASCII):
            return "not RFC 3339's shape"
        parsed = {"date": date, "time": time, "date-time": datetime}[kind].fromisoformat(v)
        if kind != "date" and parsed.tzinfo is None:
            return "no offset"
        return None
    if kind == "ipv4":
        ipaddress.IPv4Address(v)
        return None
    if kind == "ipv6":
        if "." in v or "%" in v:
            return "dotted tail or zone"
        ipaddress.IPv6Address(v)
        return None
    if kind in ("uri", "uri-reference"):
        return uri_ok(kind, v)
    if kind == "hostname":
        return hostname_ok(v)
    if kind == "duration":
        return duration_ok(v)
    if kind == "json-pointer":
        return json_pointer_ok(v)
    if kind == "email":
        a = Address(addr_spec=v)
        if a.addr_spec != v or '"' in v:
            return "not a dot-atom addr-spec"
        return None if domain_ok(a.domain) else "bad domain " + a.domain
    raise ValueError("unknown kind " + kind)


def judge(check, text):
    try:
        v = json.loads(text)
    except ValueError as e:
        return {"valid": False, "canonical": False, "why": "not JSON: %s" % e}
    canonical = json.dumps(v, ensure_ascii=False) == text.strip(" \t\n\r")
    kind = check["kind"]
    try:
        if kind == "integer":
            ok = type(v) is int and check["minimum"] <= v <= check["maximum"]
            why = None if ok else "not an integer in range"
        elif kind == "number":
            ok = type(v) in (int, float)
            ok = ok and v >= check.get("minimum", v) and v <= check.get("maximum", v)
            ok = ok and ("exclusiveMinimum" not in check or v > check["exclusiveMinimum"])
            ok = ok and ("exclusiveMaximum" not in check or v < check["exclusiveMaximum"])
            why = None if ok else "not a number in range"
            stripped = text.strip(" \t\n\r")
            canonical = bool(re.fullmatch(NUMBER_TEXT, stripped)) and not (
                stripped.startswith("-") and ok and v == 0)
        elif not isinstance(v, str):
            why = "not a string"
        else:
            why = string_ok(kind, v, check)
            if why is None and not check.get("minLength", 0) <= len(v) <= check.get("maxLength", len(v)):
                why = "%d characters" % len(v)
    except (ValueError, MessageError) as e:
        why = "%s: %s" % (type(e).__name__, e)
    return {"valid": why is None, "canonical": canonical, "why": why or ""}


def main():
    doc = json.load(sys.stdin)
    json.dump([[judge(c, t) for t in c["texts"]] for c in doc["checks"]], sys.stdout)


if __name__ == "__main__":
    main()
