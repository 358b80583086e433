"""Attention tilings on the GPU at Llama-3-8B heads (32 query heads on 8 kv heads, head_dim 128, bf16, a paged
cache of 16-key blocks at shuffled ids): each candidate's time and whether it gives every query the bits of the
16-row split tiles; prefill also against torch's scaled_dot_product_attention (causal, contiguous tensors).

python -m selfspec.bench.attention [--json attention-tiles.json]
"""
from __future__ import annotations

import argparse
import json
from typing import Callable

import torch
import torch.nn.functional as F

from selfspec.bench.device import copies_past_l2, graph_time_ms
from selfspec.kernels import triton_attention
from selfspec.kernels.triton_attention import Tiles

HQ, HKV, D, BLOCK_SIZE = 32, 8, 128, 16
BASE = Tiles()  # 16-row split tiles: the bits every candidate is compared with
DECODE_CASES = [(1, 1, 1024), (1, 1, 8192), (32, 9, 1024)]  # batch, queries per row, keys per row
# batch, prompt length (causal from position 0); 256 queries: where the dispatcher turns to the in-program path
PREFILL_CASES = [(1, 256), (1, 2048), (8, 512), (1, 8192)]
# 32 rows still take mma.sync (sm_90 PTX); 64 and 128 take wgmma.
TALL = [Tiles(32), Tiles(64), Tiles(128)]
DECODE_CANDIDATES = [BASE, *TALL]
PREFILL_CANDIDATES = [Tiles(t.block_t, in_program) for in_program in (False, True) for t in [BASE, *TALL]]


def name(tiles: Tiles) -> str:
    return f"{'in-program' if tiles.in_program else 'split'} {tiles.block_t}"


def paged_kv(b: int, s: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random pools [N, HKV, 16, D] and a block table [b, s / 16] at shuffled ids (block 0: trash, unused)."""
    w = -(-s // BLOCK_SIZE)
    table = (torch.randperm(b * w, generator=gen).view(b, w) + 1).cuda()
    k_pool, v_pool = (torch.randn(b * w + 1, HKV, BLOCK_SIZE, D, device="cuda").bfloat16() for _ in range(2))
    return k_pool, v_pool, table


def contiguous(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A pool's keys of each row as [b, HKV, s, D]."""
    b, w = table.shape
    return pool[table].permute(0, 2, 1, 3, 4).reshape(b, HKV, w * BLOCK_SIZE, D)


def sdpa_peers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """torch's causal attention on contiguous [B, H, T, D]: with its GQA flag where this torch has it, and on the kv
    heads repeated beforehand (not timed), which every backend takes."""
    n_rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    peers = {"torch sdpa repeated kv": lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True)}
    try:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        peers["torch sdpa enable_gqa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                enable_gqa=True)
    except (TypeError, RuntimeError) as e:
        print(f"torch sdpa enable_gqa: {e}")
    return peers


def measure_case(kind: str, b: int, t: int, s: int, candidates: list[Tiles], gen: torch.Generator) -> list[dict]:
    """One row per candidate: microseconds under CUDA graphs, and its bits against BASE. Decode cycles through
    enough caches to stream from HBM; a candidate that does not compile (shared memory) is recorded and skipped."""
    n_copies = copies_past_l2(2 * b * s * HKV * D * 2) if kind == "decode" else 1
    caches = [paged_kv(b, s, gen) for _ in range(n_copies)]
    q = torch.randn(b, HQ, t, D, device="cuda").bfloat16()
    pos = (s - t + torch.arange(t, device="cuda")).expand(b, t).contiguous()
    k_pool, v_pool, table = caches[0]
    base = triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=BASE)
    rows = []
    for tiles in candidates:
        row = {"kind": kind, "b": b, "t": t, "s": s, "tiles": name(tiles), "block_t": tiles.block_t,
               "in_program": tiles.in_program}
        try:
            out = triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=tiles)
        except Exception as e:  # noqa: BLE001  (Triton's compile errors have no common base class)
            rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"{kind} b={b} t={t} s={s} {name(tiles)}: {rows[-1]['error']}")
            continue
        diff = (out.float() - base.float()).abs()
        row.update(bitwise=torch.equal(out, base), mismatches=int((out != base).sum()), max_abs_diff=diff.max().item())
        row["us"] = 1000 * graph_time_ms([lambda c=c, tiles=tiles: triton_attention.attention(q, *c, pos, tiles=tiles)
                                          for c in caches])
        rows.append(row)
    if kind == "prefill":
        for peer_name, fn in sdpa_peers(q, contiguous(k_pool, table), contiguous(v_pool, table)).items():
            diff = (fn().float() - base.float()).abs().max().item()
            rows.append({"kind": kind, "b": b, "t": t, "s": s, "tiles": peer_name, "peer": True,
                         "us": 1000 * graph_time_ms([fn]), "max_abs_diff": diff})
    del caches
    return rows


def measure() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b, t, s in DECODE_CASES:
        rows += measure_case("decode", b, t, s, DECODE_CANDIDATES, gen)
    for b, t in PREFILL_CASES:
        rows += measure_case("prefill", b, t, t, PREFILL_CANDIDATES, gen)
    return rows


def table(rows: list[dict]) -> str:
    """Microseconds per call, x the case's BASE time (decode) or x torch's faster SDPA (prefill), and the bits."""
    out = ["| case | tiles | us | x ref | bits vs split 16 |", "|---|---|---|---|---|"]
    for r in rows:
        case = f"{r['kind']} B={r['b']} T={r['t']} S={r['s']}"
        if "error" in r:
            out.append(f"| {case} | {r['tiles']} | - | - | {r['error'][:60]} |")
            continue
        same_case = [x for x in rows if (x["kind"], x["b"], x["t"], x["s"]) == (r["kind"], r["b"], r["t"], r["s"])]
        refs = [x["us"] for x in same_case if x.get("peer")] or [x["us"] for x in same_case if x["tiles"] == name(BASE)]
        ref = min(refs)
        bits = "-" if "bitwise" not in r else "same" if r["bitwise"] else \
            f"{r['mismatches']} differ (max {r['max_abs_diff']:.2g})"
        out.append(f"| {case} | {r['tiles']} | {r['us']:.1f} | {r['us'] / ref:.2f} | {bits} |")
    return "\n".join(out)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    rows = measure()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": [HQ, HKV, D],
                       "block_size": BLOCK_SIZE, "rows": rows}, f, indent=1)
    print(f"{torch.cuda.get_device_name()}: Llama-3-8B heads, bf16, paged cache of {BLOCK_SIZE}-key blocks")
    print(table(rows))


if __name__ == "__main__":
    main()
