"""Programmatic dependent launch (Hopper): each Triton kernel of a decode step is launched before the one ahead of
it in the stream has fully completed, and waits for that kernel's results itself (`wait`), first thing.

At batch 1 a decode step is some ten small kernels per layer, and the gap between two of them (the launch of the
next, after the last program of the previous has exited) is a visible part of the step. Launched this way, the
next kernel's launch overlaps the previous one's completion; its programs wait on the GPU for the results. Every
such kernel waits before it reads or writes any memory, so data (and the memory a CUDA graph's pool hands from
one kernel to the next) keeps stream order along the whole chain. Letting the next kernel launch earlier still
(as soon as all programs of the previous one have started) measured slower: its waiting programs hold SM slots.
Off in Triton's interpreter (it runs no PTX) and with SELFSPEC_PDL=0; needs compute capability 9.0 or newer.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
SHARED_MEMORY = 232448  # bytes of shared memory a program may use on an H100 or H200


# The host's grids and block sizes: triton.cdiv and triton.next_power_of_2 are constexpr functions, whose calls from
# Python cost ~1.5 us each (ten and more a GEMM launch, which an eager prompt pass waits on).
def cdiv(a: int, b: int) -> int:
    """ceil(a / b)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


@functools.cache
def pdl_enabled() -> bool:
    if INTERPRETING or os.environ.get("SELFSPEC_PDL", "1") == "0" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (9, 0)


def launch_options() -> dict:
    """The launch keywords (and the PDL constexpr) of every Triton kernel of a step."""
    return dict(PDL=True, launch_pdl=True) if pdl_enabled() else dict(PDL=False)


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed and its writes are visible."""
    if PDL:
        gdc_wait()
