#!/usr/bin/env python3
"""Static throughput of the one-position MXFP4 kernels' inner loops, from `llvm-mca`.

This machine has no AVX-512, so the AVX-512 tier's speed cannot be timed here. What can be
done is to take the loop the compiler actually emitted (from the engine's release test binary)
and ask LLVM's scheduling models how many cycles it needs per MXFP4 block of 32 weights on
the CPUs that run it. It is a model (ports, latencies; no caches, no memory), so it gives the
kernel's compute ceiling, not its speed: a block is 17 bytes, so at 3 GHz one cycle per block
is 51 GB/s per core.

    python3 engine/benches/mca.py                 # builds the test binary, prints a table
    python3 engine/benches/mca.py --binary PATH   # an already built binary (another commit's)

Needs `llvm-mca` and `objdump` (binutils) on the PATH.
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile

# (function whose loop to take, multiply-adds per block of 32 weights, CPU models)
KERNELS = [
    # (LLVM 14's `sapphirerapids` uses the Skylake-SP model, so it is not listed.)
    ("stormo_engine::kernels::avx512::rows_impl", 2, ["skylake-avx512", "icelake-server"]),
    # (LLVM 14's Zen 3 model charges a 256-bit multiply-add two cycles of a pipe, so Zen 3 is
    # not listed: its figure would not be the core's.)
    ("stormo_engine::kernels::avx2::mxfp4_rows", 4, ["skylake", "icelake-server"]),
]
ITERATIONS = 1000
BLOCK_BYTES = 17


def build() -> str:
    out = subprocess.run(
        ["cargo", "test", "--release", "-p", "stormo-engine", "--lib", "--no-run",
         "--message-format=json"],
        check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg.get("executable") \
                and msg["target"]["name"] == "stormo_engine":
            return msg["executable"]
    sys.exit("mca.py: cargo built no stormo_engine test binary")


def function(binary: str, name: str) -> list[tuple[int, str]]:
    """(address, instruction) of every instruction of the function `name`."""
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", binary],
                          check=True, capture_output=True, text=True).stdout
    out, inside = [], False
    for line in dump.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            inside = head.group(1) == name
            continue
        ins = re.match(r"^\s*([0-9a-f]+):\s+(.*)$", line)
        if inside and ins:
            out.append((int(ins.group(1), 16), ins.group(2).split("#")[0].strip()))
    return out


def inner_loop(code: list[tuple[int, str]]) -> list[str]:
    """Of the innermost loops (a backward jump and its target, with no other such loop inside)
    that hold both a table permute and a multiply-add, the one with the most multiply-adds:
    the one-position kernel's loop over blocks of four rows at once. Branches and compares
    dropped."""
    loops = []
    for i, (_, ins) in enumerate(code):
        jump = re.match(r"^j\w+\s+([0-9a-f]+)", ins)
        if jump:
            target = int(jump.group(1), 16)
            start = next((k for k, (a, _) in enumerate(code) if a == target), None)
            if start is not None and start <= i:
                loops.append((start, i))
    inner = [(s, e) for s, e in loops
             if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in loops)]
    best = None
    for s, e in inner:
        body = [c for _, c in code[s:e + 1]]
        text = "\n".join(body)
        if re.search(r"vperm(d|ps)|vpshufb", text) and "vfmadd" in text:
            if best is None or text.count("vfmadd") > best[0]:
                best = (text.count("vfmadd"), body)
    if best is None:
        sys.exit("mca.py: no loop with a permute and a multiply-add found")
    return [c for c in best[1] if not re.match(r"^(j\w+|cmp|test)\b", c)]


def cycles(loop: list[str], cpu: str) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".s") as f:
        f.write("\n".join(loop) + "\n")
        f.flush()
        out = subprocess.run(["llvm-mca", f"-mcpu={cpu}", f"-iterations={ITERATIONS}", f.name],
                             check=True, capture_output=True, text=True).stdout
    return int(re.search(r"Total Cycles:\s+(\d+)", out).group(1)) / ITERATIONS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", help="the engine's test binary (default: build it)")
    args = ap.parse_args()
    binary = args.binary or build()
    print(f"binary: {binary}")
    print("| loop | CPU model | cycles per block | bytes per cycle |")
    print("|---|---|---|---|")
    for name, fmas, cpus in KERNELS:
        code = function(binary, name)
        if not code:
            sys.exit(f"mca.py: {name} not found in {binary}")
        loop = inner_loop(code)
        blocks = sum(1 for c in loop if c.startswith("vfmadd")) / fmas
        for cpu in cpus:
            c = cycles(loop, cpu) / blocks
            print(f"| {name.split('::')[-2]} ({len(loop)} instructions, {blocks:g} blocks) "
                  f"| {cpu} | {c:.2f} | {BLOCK_BYTES / c:.1f} |")


if __name__ == "__main__":
    main()
