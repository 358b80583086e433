"""Per-tile arrival counters: the last program of a group to finish does the group's final step (adding split-K
partials) in the same launch, in a fixed order, so no second kernel is needed and the result never depends on
which program came last. (Attention's chunk merge measured no faster this way than as its own kernel.)"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from selfspec.errors import SelfspecError

_COUNTS: dict[torch.device, torch.Tensor] = {}  # per device: how many programs of each group have arrived


def group_counts(device: torch.device, groups: int) -> torch.Tensor:
    """Zeroed int32 counters for `groups` groups. Every launch leaves them zero again (`last_to_arrive`), so one
    buffer serves every kernel on the device in stream order (CUDA graphs included); it grows, never inside a
    graph capture: decode passes, the graphed ones, run eagerly first."""
    counts = _COUNTS.get(device)
    if counts is None or counts.numel() < groups:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise SelfspecError(f"a GEMM of {groups} tiles first seen inside a CUDA graph capture: run the pass once "
                                "eagerly before capturing it (engine/graphs.py does)")
        counts = _COUNTS[device] = torch.zeros(max(groups, 1 << 16), dtype=torch.int32, device=device)
    return counts


@triton.jit
def last_to_arrive(count_ptr, n):
    """Count this program in at count_ptr, after all its threads' stores: True in the last of the n programs
    counting there, which then sees every other program's stores (read them with cache_modifier=".cg") and
    zeroes the count for the next launch."""
    tl.debug_barrier()  # every thread's stores happen before the release below
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel") == n - 1
    if last:
        tl.atomic_xchg(count_ptr, 0)
    return last
