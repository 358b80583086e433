"""Where a kernel's warps wait, from ncu's per-instruction samples (the CSV of `--section SourceCounters --page source
--print-source sass --csv`, as docs/bench-h200/ncu_gemm.py's docstring runs it): each file's stall reasons over all
samples, and the instructions holding the most samples with their main reason. Session 27 (the stream-K patch):
    python docs/bench-h200/sass_stalls.py head.csv stream-k.csv"""
import collections
import csv
import sys


def load(path: str) -> tuple[list[str], list[dict]]:
    rows = list(csv.reader(open(path)))
    i = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    return rows[i], [dict(zip(rows[i], r)) for r in rows[i + 1:] if len(r) == len(rows[i])]


for path in sys.argv[1:]:
    header, data = load(path)
    samples = [int(d["Warp Stall Sampling (All Samples)"] or 0) for d in data]
    total = sum(samples)
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    by_reason = collections.Counter({r: sum(int(d[r] or 0) for d in data) for r in reasons})
    executed = sum(int(d["Instructions Executed"] or 0) for d in data)
    print(f"{path}: {total} samples, {executed} warp instructions executed")
    print("  " + ", ".join(f"{r[6:]} {n / total:.2f}" for r, n in by_reason.most_common(8)))
    for s, d in sorted(zip(samples, data), key=lambda p: -p[0])[:12]:
        main = max(reasons, key=lambda r: int(d[r] or 0))
        print(f"  {s / total:.3f} {d['Source'].strip()[:60]:60s} {main[6:]}")
