"""Programmatic dependent launch (Hopper): a kernel of a decode step is launched while the one before it in the
stream finishes, and waits for that kernel's results only where it needs them.

At batch 1 a decode step is some ten small kernels per layer whose launch, ramp-up and tail cost as much as
their work. With PDL each Triton kernel lets the next one launch as soon as all its own programs have started
(`start`); the next one's programs take SMs as they free up, and a GEMM sends its first weight tiles (which no
kernel writes) towards L2 (`prefetch_l2`) before it waits. Every kernel launched this way calls `wait` before it
reads anything an earlier kernel wrote and before it writes anything, so data (and the memory a CUDA graph's pool
hands from one kernel to the next) keeps stream order; the wait returns once the previous kernel has completed,
and that kernel completed only after its own wait, so the order holds along the whole chain.
Off in Triton's interpreter (it runs no PTX) and with SELFSPEC_PDL=0; needs compute capability 9.0 or newer.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def pdl_enabled() -> bool:
    if INTERPRETING or os.environ.get("SELFSPEC_PDL", "1") == "0" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (9, 0)


def launch_options() -> dict:
    """The launch keywords (and the PDL constexpr) of every Triton kernel of a step."""
    return dict(PDL=True, launch_pdl=True) if pdl_enabled() else dict(PDL=False)


@triton.jit
def start(PDL: tl.constexpr):
    """Let the next kernel in the stream launch once every program of this one has got here."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs, PDL: tl.constexpr):
    """Ask for the 128-byte lines at ptrs in L2 (no registers filled): for data no kernel writes, before `wait`."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)
