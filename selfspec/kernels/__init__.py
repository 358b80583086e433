"""The op table: (op, variant, device type) -> implementation.

The model calls ops by name; `lookup` picks the entry registered for the tensor's device and falls back
to the torch reference ("any"), which runs everywhere and is the oracle every fast kernel is tested
against. A GPU backend adds entries; the model and the decoding loop do not change.
"""
from __future__ import annotations

from typing import Callable

_TABLE: dict[tuple[str, str, str], Callable] = {}


def register(op: str, variant: str = "", device: str = "any") -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        _TABLE[(op, variant, device)] = fn
        return fn

    return deco


def lookup(op: str, variant: str, device: str) -> Callable:
    fn = _TABLE.get((op, variant, device)) or _TABLE.get((op, variant, "any"))
    if fn is None:
        raise KeyError(f"no implementation of op '{op}' ({variant or 'default'}) for device '{device}'")
    return fn


def reference_op(op: str, variant: str = "") -> Callable:
    """The torch reference of an op (for tests of fast kernels)."""
    return _TABLE[(op, variant, "any")]


import selfspec.kernels.reference  # noqa: E402,F401  (registers the references)
import selfspec.kernels.cpu  # noqa: E402,F401  (registers the CPU kernels of the integer formats)
import selfspec.kernels.gpu  # noqa: E402,F401  (registers the Triton kernels where Triton can run)
from selfspec.kernels.ops import (Handover, HandoverRequest, attention, handover_request, linear,  # noqa: E402
                                  packed_attention, quantized_attention, quantizes_input, quarters_input, rms_norm,
                                  rms_norm_handover, rope_and_store, swiglu, swiglu_handover, tree_attention)

__all__ = ["register", "lookup", "reference_op", "Handover", "HandoverRequest", "handover_request", "linear",
           "quantizes_input", "quarters_input", "rms_norm", "rms_norm_handover", "rope_and_store", "attention",
           "packed_attention", "quantized_attention", "swiglu", "swiglu_handover", "tree_attention"]
