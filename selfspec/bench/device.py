"""GPU timing helpers shared by the benchmarks: event-timed medians and the device's copy bandwidth."""
from __future__ import annotations

from typing import Callable

import torch


def time_ms(fn: Callable[[], object], warmup: int = 5, reps: int = 30) -> float:
    """Median milliseconds of fn() on the current CUDA stream, timed with events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written (the roofline we quote)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / time_ms(lambda: dst.copy_(src), reps=10) / 1e6


def copies_past_l2(nbytes: int, total: int = 150_000_000, most: int = 64) -> int:
    """How many distinct tensors of `nbytes` a timing cycles through so that each streams from HBM, not L2; at most
    `most`: tiny tensors (smoke runs of the benchmarks) would otherwise put thousands of calls in one CUDA graph."""
    return max(1, min(most, -(-total // nbytes)))


def graph_time_ms(fns: list[Callable[[], object]], rounds: int = 4) -> float:
    """Median milliseconds per call of fns, run in turn inside one CUDA graph: no launch overhead in the figure
    (decode runs under graphs), and cycling through several weights keeps them from being served by L2."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for fn in fns:
                fn()
    return time_ms(graph.replay, warmup=2, reps=10) / (rounds * len(fns))
