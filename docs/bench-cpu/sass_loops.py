"""The loops of a GPU kernel's SASS, read on the CPU: where ncu's per-instruction warp samples went, and what the
compiler encoded.

python docs/bench-cpu/sass_loops.py samples docs/bench-h200/s20-sass-w4a16-qkv-1024.csv.gz [--top 20]
    ncu's source page (`--page source --print-source sass --csv`, as docs/bench-h200/ncu_gemm.py writes it): each
    innermost loop (a backward branch) with its samples and stall reasons, then the instructions with most samples.
python docs/bench-cpu/sass_loops.py control w4a16
    the warp-specialized nibble GEMM for a mode (selfspec.bench.kernel_resources.compile_warp_specialized), compiled
    for sm_90 here: each loop holding wgmma, its instruction mix, highest register, and the sum of the stall cycles
    the compiler encoded in its control bits (bits 41-44 of each instruction's second word), which is what a warp
    alone on its scheduler would take.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import re


def read_samples(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = f.read().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    return list(csv.DictReader(io.StringIO("\n".join(lines[head:]))))


def number(value: str) -> float:
    try:
        return float(value or 0)
    except ValueError:
        return 0.0


def innermost_loops(addresses: list[int], sources: list[str]) -> list[tuple[int, int]]:
    """(first, last) index of each backward branch's body that holds no other backward branch."""
    position = {a: i for i, a in enumerate(addresses)}
    spans = []
    for i, src in enumerate(sources):
        m = re.search(r"BRA (0x[0-9a-f]+)", src)
        target = int(m.group(1), 16) if m else None
        if target is not None and target < addresses[i] and target in position:
            spans.append((position[target], i))
    return [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]


def samples_report(path: str, top: int) -> None:
    rows = read_samples(path)
    stalls = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    base = int(rows[0]["Address"], 16)
    addresses = [int(r["Address"], 16) for r in rows]
    total = sum(number(r["# Samples"]) for r in rows)
    print(f"{path}: {total:.0f} samples over {len(rows)} instructions")
    print("| loop (offsets) | instructions | samples | share | top stalls |")
    print("|---|---|---|---|---|")
    for a, b in innermost_loops(addresses, [r["Source"] for r in rows]):
        body = rows[a:b + 1]
        n = sum(number(r["# Samples"]) for r in body)
        if n < total / 100:
            continue
        reasons = collections.Counter({k[6:]: sum(number(r[k]) for r in body) for k in stalls})
        worst = ", ".join(f"{k} {v / n:.0%}" for k, v in reasons.most_common(4))
        span = f"{addresses[a] - base:#x}-{addresses[b] - base:#x}"
        print(f"| {span} | {len(body)} | {n:.0f} | {n / total:.0%} | {worst} |")
    print(f"\nthe {top} instructions with most samples:")
    for r in sorted(rows, key=lambda r: -number(r["# Samples"]))[:top]:
        reasons = sorted(((number(r[k]), k[6:]) for k in stalls), reverse=True)[:2]
        print(f"  {int(r['Address'], 16) - base:#07x} {number(r['# Samples']):6.0f}  {r['Source'][:60]:60s} "
              + ", ".join(f"{k} {v:.0f}" for v, k in reasons if v))


def decoded_sass(sass: str) -> list[tuple[int, str, int]]:
    """(address, instruction, encoded stall cycles) of each instruction of cuobjdump's -sass listing."""
    out, lines = [], sass.splitlines()
    for i, line in enumerate(lines[:-1]):
        m = re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(.*?);\s+/\* 0x[0-9a-f]{16} \*/", line)
        second = re.search(r"/\* (0x[0-9a-f]{16}) \*/", lines[i + 1])
        if m and second:
            out.append((int(m.group(1), 16), m.group(2).strip(), (int(second.group(1), 16) >> 41) & 0xF))
    return out


def control_report(mode: str) -> None:
    from selfspec.bench.kernel_resources import compile_warp_specialized, cuobjdump
    code = decoded_sass(cuobjdump(compile_warp_specialized(mode), "-sass"))
    addresses, sources = [a for a, _, _ in code], [s for _, s, _ in code]
    print(f"{mode}: {len(code)} instructions; register requests (setmaxnreg) at "
          + ", ".join(f"{a:#x} {s.split()[0].split('.')[1].lower()} {int(s.split()[-1], 16)}"
                      for a, s, _ in code if "USETMAXREG" in s))
    print("| loop | instructions | highest register | encoded stall cycles | mix |")
    print("|---|---|---|---|---|")
    for a, b in innermost_loops(addresses, sources):
        body = code[a:b + 1]
        if not any("GMMA" in s for _, s, _ in body):
            continue
        registers = [int(r) for _, s, _ in body for r in re.findall(r"\bR(\d+)\b", s)]
        mix = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", s).split()[0].split(".")[0] for _, s, _ in body)
        print(f"| {addresses[a]:#x}-{addresses[b]:#x} | {len(body)} | R{max(registers)} | "
              f"{sum(c for _, _, c in body)} | {', '.join(f'{k} {v}' for k, v in mix.most_common(8))} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("samples")
    s.add_argument("csv")
    s.add_argument("--top", type=int, default=20)
    c = sub.add_parser("control")
    c.add_argument("mode", choices=["w4a16", "upper", "full", "w8a16"])
    args = p.parse_args()
    if args.what == "samples":
        samples_report(args.csv, args.top)
    else:
        control_report(args.mode)


if __name__ == "__main__":
    main()
