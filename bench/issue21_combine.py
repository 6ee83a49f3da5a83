"""Issue 21's verdict over several bench runs (``bench.harness.issue21_summary``): the first run
gives each case's attnc call and Flex default; later runs add Flex modes (max-autotune) only.
One JSON summary row on stdout.

    python3 -m bench.issue21_combine MAIN.jsonl [FLEX_RUN.jsonl ...] > SUMMARY.jsonl
"""
from __future__ import annotations

import json
import sys

from .harness import issue21_summary


def combine(main: str, *flex_runs: str) -> dict:
    rows = [json.loads(line) for line in open(main)]
    for path in flex_runs:  # (their attnc rows stay out: the main run's call is the one judged)
        rows += [r for r in map(json.loads, open(path)) if str(r.get("impl", "")).startswith("flex_")]
    modes = sorted({r["flex_mode"] for r in rows if "flex_mode" in r})
    return {"bench": "issue21_summary", "runs": [main, *flex_runs], **issue21_summary(rows, modes)}


if __name__ == "__main__":
    print(json.dumps(combine(*sys.argv[1:])))
