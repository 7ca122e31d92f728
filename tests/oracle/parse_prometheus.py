#!/usr/bin/python3
"""Parses Prometheus text exposition format 0.0.4 from stdin and prints it as JSON.

Oracle for tests/util/metrics_test.cpp. Two independent checks:
  1. a strict line grammar written from the format's specification (metric and label name
     charsets, label values with only the escapes \\\\, \\" and \\n, one HELP and one TYPE per
     family, before that family's samples, sample names allowed for the family's type);
  2. the parse itself by prometheus_client.parser (Debian python3-prometheus-client), the
     Prometheus project's Python client.
Output: {"families": [{"name", "type", "help", "samples": [{"name", "labels", "value"}]}]},
in input order. Family names are as prometheus_client reports them: a counter loses its
"_total" suffix (its samples keep it). Values are JSON numbers, or the strings "+Inf", "-Inf",
"NaN". A grammar violation prints one line on stderr naming the input line; exit status 1.
"""
import json
import math
import re
import sys

from prometheus_client.parser import text_string_to_metric_families

METRIC_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL_NAME = r"[a-zA-Z_][a-zA-Z0-9_]*"
LABEL_VALUE = r'"(?:[^"\\\n]|\\[\\"n])*"'
LABEL = LABEL_NAME + "=" + LABEL_VALUE
LABELS = r"\{(?:" + LABEL + r"(?:," + LABEL + r")*)?\}"
VALUE = r"(?:[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]Inf|NaN)"
SAMPLE_RE = re.compile(r"(" + METRIC_NAME + r")(" + LABELS + r")? " + VALUE + r"(?: -?\d+)?")
HELP_RE = re.compile(r"# HELP (" + METRIC_NAME + r") ?((?:[^\\\n]|\\[\\n])*)")
TYPE_RE = re.compile(r"# TYPE (" + METRIC_NAME + r") (counter|gauge|histogram|summary|untyped)")
LABEL_NAME_RE = re.compile(r"(" + LABEL_NAME + r")=" + LABEL_VALUE)

SUFFIXES = {
    "counter": [""],
    "gauge": [""],
    "untyped": [""],
    "histogram": ["_bucket", "_sum", "_count"],
    "summary": ["", "_sum", "_count"],
}


def fail(lineno, message, line):
    sys.stderr.write("line %d: %s: %r\n" % (lineno, message, line))
    sys.exit(1)


def check_grammar(text):
    if text and not text.endswith("\n"):
        fail(text.count("\n") + 1, "the last line must end with a newline", text.split("\n")[-1])
    helped, typed, sampled = set(), {}, set()
    current = None
    for lineno, line in enumerate(text.split("\n")[:-1], start=1):
        if line.startswith("# HELP "):
            m = HELP_RE.fullmatch(line)
            if not m:
                fail(lineno, "malformed HELP line", line)
            name = m.group(1)
            if name in helped:
                fail(lineno, "second HELP for " + name, line)
            if name in sampled:
                fail(lineno, "HELP after samples of " + name, line)
            helped.add(name)
            current = name
        elif line.startswith("# TYPE "):
            m = TYPE_RE.fullmatch(line)
            if not m:
                fail(lineno, "malformed TYPE line", line)
            name = m.group(1)
            if name in typed:
                fail(lineno, "second TYPE for " + name, line)
            if name in sampled:
                fail(lineno, "TYPE after samples of " + name, line)
            typed[name] = m.group(2)
            current = name
        elif line.startswith("#") or line == "":
            continue
        else:
            m = SAMPLE_RE.fullmatch(line)
            if not m:
                fail(lineno, "malformed sample line", line)
            if current is None or current not in typed:
                fail(lineno, "sample before its TYPE line", line)
            allowed = [current + s for s in SUFFIXES[typed[current]]]
            if m.group(1) not in allowed:
                fail(lineno, "sample name not allowed for %s %s" % (typed[current], current), line)
            names = LABEL_NAME_RE.findall(m.group(2) or "")
            if len(names) != len(set(names)):
                fail(lineno, "repeated label name", line)
            sampled.add(current)


def json_value(v):
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return v


def main():
    text = sys.stdin.read()
    check_grammar(text)
    families = []
    for family in text_string_to_metric_families(text):
        families.append({
            "name": family.name,
            "type": family.type,
            "help": family.documentation,
            "samples": [{"name": s.name, "labels": s.labels, "value": json_value(s.value)}
                        for s in family.samples],
        })
    json.dump({"families": families}, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
