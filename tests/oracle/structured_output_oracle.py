"""Oracle for structured outputs: Python's re and the jsonschema package judge what Tandem's
grammars accepted. Reads a JSON document on stdin:
  {"regex": [{"pattern": P, "texts": [...]}, ...],
   "schema": [{"schema": S, "answers": [...]}, ...]}
and writes {"regex": [[bool per text], ...], "schema": [[error or null per answer], ...]}:
re.fullmatch for each text (or the re.error text, for a pattern that does not compile), and for each answer null when it parses as JSON and validates
(Draft 2020-12), else the reason.

"ascii": true compiles the patterns with re.ASCII; "flavour": "tandem" with Tandem's classes
instead: \s as re has it for str patterns (Unicode white space), \d and \w ASCII (as re.ASCII,
through scoped (?a:...) groups)."""
import json
import re
import sys

import jsonschema


def tandem_flavour(pattern):
    """`pattern` with \\d \\D \\w \\W made ASCII and \\s left Unicode."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            e = pattern[i + 1]
            if e in "dDwW":
                if in_class:
                    if e in "DW":
                        raise ValueError("\\D or \\W inside a class: " + pattern)
                    out.append("0-9" if e == "d" else "0-9A-Za-z_")
                else:
                    out.append("(?a:\\" + e + ")")
            else:
                out.append(c + e)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            i += 1
            # A ']' first in the class (after '^') is a literal.
            if i < len(pattern) and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < len(pattern) and pattern[i] == "]":
                out.append("]")
                i += 1
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
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
