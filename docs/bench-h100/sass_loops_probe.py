"""The loops of the warp-specialized nibble GEMM's SASS (sm_90, compiled offline: no GPU), with the instructions
each holds by kind: the K-tile loop is the one with 8 HGMMA at the width of interest. Run from the repository root:
`PYTHONPATH=. python docs/bench-h100/sass_loops_probe.py` (2026-11-27: w4a16's 128-wide K-tile loop is 391
instructions a warp on main; 232 on the branch lead/nibble-offsets-at-end, whose offsets' loop adds 214 a tile)."""
import re, subprocess, tempfile, collections
from pathlib import Path
from selfspec.bench import kernel_resources as kr
import triton
def sass(kernel):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"]); f.flush()
        tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
txt = sass(kr.compile_warp_specialized("w4a16"))
lines = [l for l in txt.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/\s", l)]
addr = lambda l: int(re.search(r"/\*([0-9a-f]{4,})\*/", l).group(1), 16)
# loops: backward branches BRA to a lower address
loops = []
for l in lines:
    m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", l)
    if m and "BRA" in l:
        tgt = re.search(r"0x([0-9a-f]+)", l.split("BRA")[1])
        if tgt and int(tgt.group(1), 16) < addr(l):
            loops.append((int(tgt.group(1), 16), addr(l)))
for a, b in loops:
    body = [l for l in lines if a <= addr(l) <= b]
    ops = collections.Counter(re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", l).group(1) for l in body)
    if ops.get("HGMMA") or ops.get("FFMA", 0) > 20:
        print(hex(a), hex(b), len(body), {k: ops[k] for k in ("HGMMA", "FFMA", "FMUL", "FADD", "LDS", "LDG", "PRMT", "LOP3", "F2FP", "MOV", "IMAD", "SYNCS", "BAR")})
