"""act_quant with several rows a program (a [ROWS, K] block: each row's max, codes and sums as act_quant makes them)
against triton_linear._act_quant (one row a program), K = 4,096, under CUDA graphs cycling through inputs past L2;
each variant's codes, scales and sums checked against act_quant's. Session 29:
    PYTHONPATH=. python docs/bench-h200/act_quant_rows_probe.py"""
import torch
import triton
import triton.language as tl

from selfspec.bench.device import copies_past_l2, graph_time_ms
from selfspec.kernels import triton_linear
from selfspec.kernels.triton_small import ROW_SUM_COLS, row_codes, row_scale


@triton.jit
def _rows_kernel(x_ptr, q_ptr, s_ptr, sums_ptr, M, K, QMAX: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    live = rows < M
    mask = live[:, None] & (offs < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * K + offs[None, :], mask=mask, other=0).to(tl.float32)
    scale = row_scale(tl.max(tl.abs(x), axis=1), QMAX)
    q = row_codes(x, scale[:, None], QMAX)
    tl.store(q_ptr + rows[:, None] * K + offs[None, :], q.to(tl.int8), mask=mask)
    tl.store(s_ptr + rows, scale, mask=live)
    n: tl.constexpr = BLOCK // ROW_SUM_COLS
    sums = tl.sum(tl.reshape(q, (ROWS, n, ROW_SUM_COLS)), axis=2)
    idx = tl.arange(0, n)
    tl.store(sums_ptr + rows[:, None] * (K // ROW_SUM_COLS) + idx[None, :], sums,
             mask=live[:, None] & (idx < K // ROW_SUM_COLS)[None, :])


def rows_quant(x: torch.Tensor, rows: int, warps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    sums = torch.empty((m, k // ROW_SUM_COLS.value), dtype=torch.float32, device=x.device)
    _rows_kernel[(triton.cdiv(m, rows),)](x, q, s, sums, m, k, QMAX=127.0, BLOCK=triton.next_power_of_2(k),
                                          ROWS=rows, num_warps=warps)
    return q, s, sums


k = 4096
for m in (1, 16, 256, 1024, 4096):
    xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in range(copies_past_l2(2 * m * k))]
    want = triton_linear._act_quant(xs[0], 8, sums=True)
    base = graph_time_ms([lambda x=x: triton_linear._act_quant(x, 8, sums=True) for x in xs])
    cells = [f"act_quant {1000 * base:6.1f} us"]
    for rows, warps in ((1, 8), (2, 8), (4, 8), (8, 8), (4, 16), (8, 16)):
        same = all(torch.equal(a, b) for a, b in zip(rows_quant(xs[0], rows, warps), want))
        ms = graph_time_ms([lambda x=x: rows_quant(x, rows, warps) for x in xs])
        cells.append(f"{rows}x{warps}w {1000 * ms:6.1f} us{'' if same else ' bits!'}")
    gb = m * k * (2 + 1 + 4 / 64) / 1e3
    print(f"m={m:5d} ({gb:.0f} KB): " + ", ".join(cells), flush=True)
