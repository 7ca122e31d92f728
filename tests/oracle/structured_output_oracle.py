"""Oracle for structured outputs: Python's re and the jsonschema package judge what Tandem's
grammars accepted. Reads a JSON document on stdin:
  {"regex": [{"pattern": P, "texts": [...]}, ...],
   "schema": [{"schema": S, "answers": [...]}, ...]}
and writes {"regex": [[bool per text], ...], "schema": [[error or null per answer], ...]}:
re.fullmatch for each text, and for each answer null when it parses as JSON and validates
(Draft 2020-12), else the reason."""
import json
import re
import sys

import jsonschema


def main():
    doc = json.load(sys.stdin)
    out = {"regex": [], "schema": []}
    for case in doc.get("regex", []):
        rx = re.compile(case["pattern"], re.ASCII if doc.get("ascii") else 0)
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
