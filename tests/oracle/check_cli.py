#!/usr/bin/env python3
"""Run `stormo run --json` on every fixture under fixtures/extra and compare the generated ids
with Transformers' (reference.json). Standard library only.

    cargo build -p stormo-node
    python3 tests/oracle/check_cli.py [--stormo PATH] [NAME ...]

PATH defaults to $CARGO_TARGET_DIR/debug/stormo, else target/debug/stormo. Exits non-zero if
any fixture disagrees or the binary fails.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    ap.add_argument("--stormo", default=str(target / "debug" / "stormo"), help="the stormo binary")
    ap.add_argument("names", nargs="*", help="fixtures to check; default all")
    args = ap.parse_args()
    dirs = sorted(p for p in (ROOT / "fixtures" / "extra").iterdir() if (p / "config.json").is_file())
    if args.names:
        dirs = [d for d in dirs if d.name in args.names]
    if not dirs:
        sys.exit("no fixtures selected")
    bad = 0
    for d in dirs:
        ref = json.loads((d / "reference.json").read_text())
        want = ref["generated_ids"]
        cmd = [
            args.stormo,
            "run",
            "--model",
            str(d),
            "--prompt-ids",
            ",".join(map(str, ref["input_ids"])),
            "--max-new-tokens",
            str(len(want)),
            "--json",
        ]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"{d.name}: stormo exited {p.returncode}: {p.stderr.strip()}")
            bad += 1
            continue
        got = json.loads(p.stdout)["generated_ids"]
        if got == want:
            print(f"{d.name}: {len(got)} ids identical")
        else:
            first = next(i for i, (a, b) in enumerate(zip(got + [None] * len(want), want)) if a != b)
            print(f"{d.name}: MISMATCH from step {first}: stormo {got}, Transformers {want}")
            bad += 1
    if bad:
        sys.exit(f"{bad} of {len(dirs)} fixtures disagree")


if __name__ == "__main__":
    main()
