"""Oracle for structured outputs: Python's re and the jsonschema package judge what Tandem's
grammars accepted. Reads a JSON document on stdin:
  {"regex": [{"pattern": P, "texts": [...]}, ...],
   "schema": [{"schema": S, "answers": [...]}, ...]}
and writes {"regex": [[bool per text], ...], "schema": [[error or null per answer], ...]}:
re.fullmatch for each text (or the re.error text, for a pattern that does not compile), and for each answer null when it parses as JSON and validates
(Draft 2020-12), else the reason.

"ascii": true compiles the patterns with re.ASCII; "flavour": "tandem" with Tandem's classes
instead (src/structured/regex.h): \s and \S as re has them for str patterns (Unicode white space),
\d \D \w \W as re.ASCII has them, through scoped (?a:...) groups (neither flag alone gives this
mix). Nothing else is rewritten: '.', escapes and the rest are re's own."""
import json
import re
import sys

import jsonschema


def tandem_flavour(pattern):
    """`pattern` with \\d \\D \\w \\W made ASCII and \\s \\S left Unicode, through scoped
    (?a:...) groups, so that Python's re itself judges (it has no flag for this mix)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            e = pattern[i + 1]
            out.append("(?a:\\" + e + ")" if e in "dDwW" else c + e)
            i += 2
        elif c == "[":
            end = class_end(pattern, i)
            out.append(ascii_class(pattern[i:end]))
            i = end
        else:
            out.append(c)
            i += 1
    return "".join(out)


def class_end(pattern, i):
    """Where the class that opens at pattern[i] ends (past its ']')."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":  # a ']' first in the class is a literal
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def ascii_class(cls):
    """A class with its \\d \\w ASCII: spelled out as ranges, or (with \\D or \\W, which a
    class cannot spell out) the whole class scoped ASCII, which only \\s \\S would feel."""
    escapes = {cls[k + 1] for k in range(len(cls) - 1) if cls[k] == "\\"}
    if escapes & set("DW"):
        if escapes & set("sS"):
            raise ValueError("\\D or \\W beside \\s or \\S in a class: " + cls)
        return "(?a:" + cls + ")"
    out, k = [], 0
    while k < len(cls):
        if cls[k] == "\\" and k + 1 < len(cls):
            e = cls[k + 1]
            out.append({"d": "0-9", "w": "0-9A-Za-z_"}.get(e, cls[k : k + 2]))
            k += 2
        else:
            out.append(cls[k])
            k += 1
    return "".join(out)


def main():
    doc = json.load(sys.stdin)
    out = {"regex": [], "schema": []}
    for case in doc.get("regex", []):
        try:
            if doc.get("flavour") == "tandem":
                rx = re.compile(tandem_flavour(case["pattern"]))
            else:
                rx = re.compile(case["pattern"], re.ASCII if doc.get("ascii") else 0)
        except re.error as e:
            out["regex"].append("re.error: %s" % e)
            continue
        out["regex"].append([rx.fullmatch(t) is not None for t in case["texts"]])
    for case in doc.get("schema", []):
        validator = jsonschema.Draft202012Validator(case["schema"])
        results = []
        for a in case["answers"]:
            try:
                value = json.loads(a)
            except ValueError as e:
                results.append("not JSON: %s" % e)
                continue
            errors = sorted(validator.iter_errors(value), key=str)
            results.append(None if not errors else errors[0].message)
        out["schema"].append(results)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
