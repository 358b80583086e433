"""What the model calls: each op looks itself up in the table by the device of its input."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from selfspec import kernels
from selfspec.quant.formats import QuantWeight
from selfspec.quant.modes import Mode

# The width of each sum of codes that `rms_norm_handover` and `swiglu_handover` write for `linear` ([rows, D / 64]).
ROW_SUM_COLS = 64

if TYPE_CHECKING:
    from selfspec.cache.kv import LayerKV
    from selfspec.model import Packed, TreeLayout


@dataclass(frozen=True)
class Handover:
    """What the op that wrote a linear's input x (a norm, swiglu) computed of each row in its one pass over it, so
    that the linear does not compute it again: for a mode that quantizes activations to `bits`, `codes` (int8
    [rows, K]) and `scale` (fp32 [rows, 1]): x quantized per token exactly as the linear would quantize it
    (quant/act.py), and in `sums` the codes' sums per ROW_SUM_COLS columns [rows, K / ROW_SUM_COLS] (exact integers)
    or None. The same values either way, so they may come on some calls and not on others. With `quartered` (a K
    tile, the linear's `quarters_input`), x itself was written with each tile's columns quartered, in the order the
    nibble kernels read it (gluon_linear.quartered): the linear reads it as it is instead of quartering it."""
    sums: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    bits: int | None = None
    quartered: int = 0

    def codes_for(self, bits: int | None) -> bool:
        """Whether this carries x's codes at `bits` (a mode's act_bits)."""
        return bits is not None and self.codes is not None and self.bits == bits


@dataclass(frozen=True)
class HandoverRequest:
    """What a linear asks of the op that writes its input x (`handover_request`), which that op does in its one pass
    over x where its device can, and reports in the `Handover` it returns: x's codes at `act_bits` (None: none), x
    written with each K tile of `quartered` columns quartered (0: in order)."""
    act_bits: int | None = None
    quartered: int = 0


def linear(x: torch.Tensor, weight: QuantWeight, mode: Mode, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, handover: Handover | None = None) -> torch.Tensor:
    """x @ W^T (+ bias), W read as `mode` says; + residual, when given, in the same pass over the output. handover:
    what the op that wrote x computed of it for this linear (`Handover`), which a device's GEMM may use."""
    weight = weight.for_mode(mode)  # a format with a copy per mode (dense+int4) hands over the one `mode` reads
    if handover is not None and handover.quartered and weight.rotation is not None:
        raise ValueError("x came quartered for a linear that rotates it: `quarters_input` gives 0 for rotated weights")
    if weight.rotation is not None:  # stored as W H: (x H)(W H)^T = x W^T, with outliers spread before act quant
        x, handover = rotate(x, weight.rotation.matrix), None  # it was x's, not x H's
    return kernels.lookup("linear", weight.storage, x.device.type)(x, weight, mode, bias, residual, handover)


def quantizes_input(weight: QuantWeight, mode: Mode) -> int | None:
    """The bits to which `linear` quantizes x per token in `mode` (None: it does not, or it rotates x first): what
    the op writing x may quantize for it (`rms_norm_handover`, `swiglu_handover`)."""
    return None if weight.for_mode(mode).rotation is not None else mode.act_bits


def quarters_input(weight: QuantWeight, mode: Mode, rows: int, device: torch.device) -> int:
    """The K tile by which `linear` quarters the columns of x [rows, K] on `device` in `mode` (0: it does not), which
    the op writing x may do for it as it writes (`rms_norm_handover`, `swiglu_handover`, Handover.quartered)."""
    if weight.for_mode(mode).rotation is not None:
        return 0
    return kernels.lookup("quarters_input", "", device.type)(weight, mode, rows, device)


def handover_request(weight: QuantWeight, mode: Mode, rows: int, device: torch.device) -> HandoverRequest:
    """What `linear` of x [rows, K] on `device` in `mode` asks of the op writing x (`quantizes_input`,
    `quarters_input`)."""
    return HandoverRequest(quantizes_input(weight, mode), quarters_input(weight, mode, rows, device))


def rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x @ blockdiag(h, ..., h) along the last dim: the Hadamard rotation of activations (quant/rotation.py)."""
    return kernels.lookup("rotate", "", x.device.type)(x, h)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return kernels.lookup("rms_norm", "", x.device.type)(x, weight, eps)


def rms_norm_handover(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      request: HandoverRequest = HandoverRequest()) -> tuple[torch.Tensor, Handover | None]:
    """rms_norm, and what it hands the linear that reads its output where the device's GEMMs take it (`Handover`),
    as that linear's `request` asks: its codes; the output itself quartered, where the device writes it so
    (Handover.quartered says). None where the device takes none."""
    return kernels.lookup("rms_norm_handover", "", x.device.type)(x, weight, eps, request.act_bits,
                                                                  request.quartered)


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """RoPE on q and k, rope(k) and v stored into the KV pools; returns rope(q) [B, Hq, T, D].

    q [B, Hq, T, D], k, v [B, Hkv, T, D] (any strides); cos, sin [B, T, D] float32; pools [N, Hkv, bs, D] (the
    layout `attention` reads); slots [B, T] int64: token (b, t) goes to pool[s // bs, :, s % bs], s = slots[b, t].
    k and v are rounded to the pools' dtype."""
    return kernels.lookup("rope_and_store", "", q.device.type)(q, k, v, cos, sin, k_pool, v_pool, slots)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return kernels.lookup("swiglu", "", gate.device.type)(gate, up)


def swiglu_handover(gate: torch.Tensor, up: torch.Tensor,
                    request: HandoverRequest = HandoverRequest()) -> tuple[torch.Tensor, Handover | None]:
    """swiglu, and what it hands the linear that reads its output (as `rms_norm_handover`)."""
    return kernels.lookup("swiglu_handover", "", gate.device.type)(gate, up, request.act_bits, request.quartered)


def attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
              q_pos: torch.Tensor, prompt: bool = False, tails: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, T, D] at positions q_pos [B, T]; keys and values in pools [N, Hkv, bs, D] of blocks of bs
    positions, row b's key s at pool[table[b, s // bs], :, s % bs] (table [B, W]; GQA when Hkv < Hq).
    Query (b, t) reads keys 0..q_pos[b, t]; later slots may hold stale scratch. A contiguous cache [B, Hkv, S, D]
    is the case of one block of S positions per row (table[b] = [b]). prompt: the queries are prompt tokens
    (Mode.prompt), which a device may run in their own arithmetic, the same for every prompt token.
    tails [B, T]: row b's keys from its first query's position p0 = q_pos[b, 0] on are its queries' own, stored
    elsewhere: key p0 + i is read at position tails[b, i] (a tree's branch rows sharing one sequence's row,
    model.TreeLayout). Each key keeps its logical place, so a query gets the bits of a row holding them in order.
    A query of such a row at a position not past its predecessor's is a branch's padding: a device may leave its
    output undefined (the model drops it), and skips its tiles."""
    return kernels.lookup("attention", "", q.device.type)(q, k_pool, v_pool, table, q_pos, prompt, tails=tails)


def tree_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                   q_pos: torch.Tensor, tree: TreeLayout) -> torch.Tensor:
    """`attention` of a tree pass whose branch rows share their sequence's cache row (model.TreeLayout with tails
    and starts): q [R, Hq, T, D] and q_pos [R, T] in branch rows. Only the entries tree.first names (each node's
    first) are defined, each with the bits `attention` gives it; a device may compute each node's query once."""
    return kernels.lookup("tree_attention", "", q.device.type)(q, k_pool, v_pool, table, q_pos, tree)


def packed_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                     q_pos: torch.Tensor, packed: Packed, prompt: bool = False) -> torch.Tensor:
    """`attention` of the rows of a packed pass (model.Packed): q [1, Hq, N, D] at positions q_pos [1, N], row b's
    queries reading keys through table[b] -> [1, Hq, N, D]."""
    return kernels.lookup("packed_attention", "", q.device.type)(q, k_pool, v_pool, table, q_pos, packed, prompt)


def quantized_attention(q: torch.Tensor, kv: LayerKV, q_pos: torch.Tensor, upper: bool,
                        packed: Packed | None = None) -> torch.Tensor:
    """`attention` over a quantized cache (cache/quant_kv.py): query (b, t) at position p = q_pos[b, t] reads keys
    below quantized_below(p) from row b's quantized groups (kv.quant's blocks through kv.quant.table[b]; the upper
    plane alone where `upper` and the cache is hierarchical) and keys up to p from row b's full-precision buffer
    (block kv.table[b, 0] of kv.k/kv.v, slot = p - kv.quant.start[b]). q [B, Hq, T, D] -> [B, Hq, T, D]. With
    `packed`, q [1, Hq, N, D] and q_pos [1, N] hold the rows it describes: padded to [B, T] for the kernel (padding
    repeats a row's last query, whose output is dropped)."""
    fn = kernels.lookup("quantized_attention", "", q.device.type)
    if packed is None:
        return fn(q, kv, q_pos, upper)
    return packed.unpad_heads(fn(packed.pad_heads(q), kv, packed.pad(q_pos), upper))
