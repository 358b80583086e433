"""Decoder-only transformer (Llama, Mistral, Qwen2/2.5, Qwen3) whose every linear runs in a chosen mode.

forward(tokens, positions, cache, mode): `mode` is a value passed down the call, not a second model:
each linear reads its one stored weight the way the mode says.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import nn

from selfspec.cache import KVCache
from selfspec.cache.quant_kv import QuantKVCache
from selfspec.config import ModelConfig
from selfspec.errors import SelfspecError
from selfspec.host import long_tensor
from selfspec.kernels import (Handover, HandoverRequest, attention, handover_request, linear, packed_attention,
                              quantized_attention, rms_norm, rms_norm_handover, rope_and_store, swiglu_handover,
                              tree_attention)
from selfspec.parallel import SOLO, TensorParallel
from selfspec.quant.formats import DenseWeight, QuantWeight, quantize_weight
from selfspec.quant.kv import check_kv_format
from selfspec.quant.modes import MODES, Mode


@dataclass
class Packed:
    """Rows of different lengths in one pass without padding. The pass's tokens [1, N] are the rows' tokens back to
    back (row 0's first), so every op but attention runs on the N real tokens only; attention (kernels/ops.py
    `packed_attention`) reads each row's keys through its own block table. lengths: each row's tokens; keys: the
    keys each row's last token reads (its position + 1). In the rows' padded layout [B, T]: index [B, T] is the
    packed token at each entry (padding repeats its row's last token, and its output is dropped), where [N] each
    packed token's entry b * T + t."""
    lengths: list[int]
    keys: list[int]
    index: torch.Tensor
    where: torch.Tensor

    @classmethod
    def of(cls, lengths: list[int], keys: list[int], device: torch.device | str = "cpu",
           shape: tuple[int, int, int] | None = None) -> Packed:
        """The rows `lengths` packed; with shape (tokens, rows, width), laid out in a pass padded past them (a CUDA
        graph's, engine/graphs.py): tokens past the rows' are padding, and so are rows past theirs, which read the
        first padding token; a padding token's entry is the last row's first, whose block table is all trash, so its
        KV lands in the trash block. The padding is in index and where only: such a pass runs the packed attention of
        the GPU (kernels/reference.py: pad, attention, unpad), not the CPU's, which reads lengths."""
        # numpy: torch's CPU ops here cost 5 ms a 32-prompt pass on a 16-core GPU host (repeat_interleave's
        # threads), the GPU idle meanwhile; numpy's 0.1 ms.
        n = np.asarray(lengths, dtype=np.int64)
        real = int(n.sum())
        tokens, rows, width = shape or (real, len(lengths), int(n.max()))
        if tokens < real or rows < len(lengths) or width < int(n.max()) or (rows > len(lengths)) != (tokens > real):
            raise SelfspecError(f"a pass of {tokens} tokens in {rows} rows of {width} cannot hold rows {lengths} "
                                "(padding rows need padding tokens, and padding tokens a padding row)")
        starts = np.cumsum(n) - n
        index = np.full((rows, width), real, dtype=np.int64)
        index[:len(lengths)] = starts[:, None] + np.minimum(np.arange(width), n[:, None] - 1)
        row = np.repeat(np.arange(len(lengths)), n)
        where = np.full(tokens, (rows - 1) * width, dtype=np.int64)
        where[:real] = row * width + np.arange(real) - starts[row]
        return cls(lengths, keys, torch.from_numpy(index).to(device), torch.from_numpy(where).to(device))

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[1, N, ...] -> [B, T, ...]"""
        return x[0][self.index]

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [1, N, ...]"""
        return x.flatten(0, 1)[self.where][None]

    def pad_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[1, H, N, ...] -> [B, H, T, ...] (attention's queries and outputs)"""
        return self.pad(x.transpose(1, 2)).transpose(1, 2)

    def unpad_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, T, ...] -> [1, H, N, ...]"""
        return self.unpad(x.transpose(1, 2)).transpose(1, 2)


@dataclass(frozen=True)
class TreeLayout:
    """Token trees in one pass, each node run once: the pass's tokens [1, N] are the trees' nodes (a sequence's
    pending token, then its drafts), so every op but attention runs on the N nodes only. Attention runs on the
    branches as rows [R, T], each a chain over its own cache row, as forked chains: a node's KV is stored in every
    row that holds it, so a branch's verify is the chain verify of that branch, bit for bit (the per-token ops are
    batch invariant). rows [R, T]: the node at each branch position (past a branch's end, its last node again:
    stored at its own slot again, output dropped); first [N]: each node's entry r * T + t in the first row holding
    it (a node past the trees', padding: entry 0). tails [R, T], where the branch rows share their sequence's cache
    row instead (`of(shared=True)`): each node's KV is stored once, a sequence's nodes in node order from its
    pending token's position, and a branch row reads its own keys there (kernels/ops.py `attention`'s tails), each
    in its chain's place: the chain's bits, and no committed key copied or read from memory once per branch.
    starts [S + 1], with tails: each sequence's first node (its pending token), then N; attention then runs each
    node's query once at its `first` entry (kernels/ops.py `tree_attention`)."""
    rows: torch.Tensor
    first: torch.Tensor
    tails: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    host_rows: list[list[int]] = field(default_factory=list, compare=False)  # as the host built them: no copy back
    host_tokens: list[int] = field(default_factory=list, compare=False)
    # `of`'s values on the host, side by side: rows, first, tokens, positions, tails, starts (a graph copies them)
    host: np.ndarray | None = field(default=None, compare=False)

    @classmethod
    def of(cls, trees: list[tuple[int, int, list[list[int]]]], device: torch.device | str = "cpu",
           shared: bool = False, width: int = 0) -> tuple[TreeLayout, torch.Tensor, torch.Tensor]:
        """trees: (pending token, its position, branches) per sequence, a branch's tokens following the pending
        one; a sequence's rows are its branches in order (one row if it has none). Returns the layout, the nodes'
        tokens [N] and positions [N]. shared: the branch rows share their sequence's cache row (`tails`). width: rows
        at least this wide (a captured graph's: its longest branch + 1 where that is more)."""
        tokens, pos, rows, roots, starts = [], [], [], [], []
        for pending, length, branches in trees:
            root, index = len(tokens), {}
            starts.append(root)
            tokens.append(pending)
            pos.append(length)
            for branch in branches or [[]]:
                row = [root]
                for d in range(len(branch)):
                    node = index.setdefault(tuple(branch[:d + 1]), len(tokens))
                    if node == len(tokens):
                        tokens.append(branch[d])
                        pos.append(length + d + 1)
                    row.append(node)
                rows.append(row)
                roots.append(root)
        width = max(width, *map(len, rows))
        rows = [r + [r[-1]] * (width - len(r)) for r in rows]
        first = {}
        for i, row in enumerate(rows):
            for t, node in enumerate(row):
                first.setdefault(node, i * width + t)
        n, cut = len(tokens), len(rows) * width
        # A node's tail: its sequence's pending token's position + its index among the sequence's nodes.
        tails = [pos[root] + node - root for row, root in zip(rows, roots) for node in row] if shared else []
        starts = starts + [n] if shared else []
        # One copy to the device: the rows, first, tokens, positions, tails and starts side by side.
        host = long_tensor([x for r in rows for x in r] + [first[i] for i in range(n)] + tokens + pos + tails + starts)
        flat = host.to(device)
        end = cut + 3 * n + len(tails)
        layout = cls(flat[:cut].view(len(rows), width), flat[cut:cut + n],
                     flat[cut + 3 * n:end].view(len(rows), width) if shared else None,
                     flat[end:] if shared else None, rows, tokens, host.numpy())
        return layout, flat[cut + n:cut + 2 * n], flat[cut + 2 * n:cut + 3 * n]


@dataclass(frozen=True)
class ForwardBatch:
    """What every layer of one forward pass reads, built once per pass: the mode, the tokens' positions [B, T]
    (packed: [1, N]; a tree pass: its branch rows'), their rope angles [B, T, D] and cache slots [B, T], the cache
    (or its batch view) and, for a packed pass, how its tokens split into rows; for a tree pass, its layout."""
    mode: Mode
    pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    cache: KVCache
    packed: Packed | None = None
    tree: TreeLayout | None = None


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight: QuantWeight = DenseWeight(weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor, mode: Mode, residual: torch.Tensor | None = None,
                handover: Handover | None = None) -> torch.Tensor:
        return linear(x, self.weight, mode, self.bias, residual, handover)

    def request(self, mode: Mode, rows: int, device: torch.device) -> HandoverRequest:
        """What this linear asks in `mode` of the op writing its input of `rows` rows on `device` (kernels.Handover)."""
        return handover_request(self.weight, mode, rows, device)


class RowParallelLinear(Linear):
    """A linear whose input features are split across the tensor-parallel ranks: each rank's partial product, then
    one all-reduce. The bias and the residual are added on rank 0 only (every rank adding them, the all-reduce would
    add them N times: vLLM's RowParallelLinear). Alone (SOLO) it is a plain Linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel):
        super().__init__(weight, bias if tp.rank == 0 else None)
        self.tp = tp

    def forward(self, x: torch.Tensor, mode: Mode, residual: torch.Tensor | None = None,
                handover: Handover | None = None) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x, mode, residual if self.tp.rank == 0 else None, handover))


def concat_bias(sd: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor | None:
    """The biases of linears fused into one (rows stacked): all or none of them have one."""
    biases = [sd.get(n + ".bias") for n in names]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise SelfspecError(f"{', '.join(names)}: some have a bias and some not; a fused projection needs all or none")
    return torch.cat(biases)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def handover(self, x: torch.Tensor, reader: Linear, mode: Mode) -> tuple[torch.Tensor, Handover | None]:
        """The norm, and what it hands the linear that reads it in `mode` (kernels.Handover)."""
        return rms_norm_handover(x, self.weight, self.eps, reader.request(mode, x.numel() // x.shape[-1], x.device))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, sd: dict[str, torch.Tensor], p: str, tp: TensorParallel = SOLO):
        super().__init__()
        self.cfg = cfg
        # q, k and v as one weight (rows stacked): one GEMM, one activation rotation/quantization per layer.
        # Under tensor parallelism sd holds this rank's heads only (parallel/shard.py).
        names = [p + f"{x}_proj" for x in "qkv"]
        self.wqkv = Linear(torch.cat([sd[n + ".weight"] for n in names]), concat_bias(sd, names))
        self.sizes = [cfg.n_heads // tp.size * cfg.head_dim] + 2 * [cfg.n_kv_heads // tp.size * cfg.head_dim]
        self.wo = RowParallelLinear(sd[p + "o_proj.weight"], sd.get(p + "o_proj.bias"), tp)
        self.q_norm = RMSNorm(sd[p + "q_norm.weight"], cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(sd[p + "k_norm.weight"], cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, fb: ForwardBatch, layer: int, residual: torch.Tensor,
                handover: Handover | None = None) -> torch.Tensor:
        """residual + attention(x): the output projection adds the residual as it writes its output. handover: what
        the norm computed of x for wqkv (kernels.Handover)."""
        hd = self.cfg.head_dim
        qkv = self.wqkv(x, fb.mode, handover=handover)
        if fb.tree is not None:  # the nodes laid out as branch rows
            qkv = qkv[0][fb.tree.rows]
        b, t, _ = qkv.shape
        q, k, v = (z.view(b, t, -1, hd) for z in qkv.split(self.sizes, dim=-1))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        kv = fb.cache.layer(layer)
        q = rope_and_store(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), fb.cos, fb.sin, kv.k, kv.v,
                           fb.slots)
        if kv.quant is not None:  # the mode says which planes of a hierarchical cache it reads
            out = quantized_attention(q, kv, fb.pos, fb.mode.kv_upper, fb.packed)
        elif fb.tree is not None and fb.tree.starts is not None:  # each node's query once
            out = tree_attention(q, kv.k, kv.v, kv.table, fb.pos, fb.tree)
        elif fb.packed is None:
            out = attention(q, kv.k, kv.v, kv.table, fb.pos, fb.mode.prompt,
                            tails=None if fb.tree is None else fb.tree.tails)
        else:
            out = packed_attention(q, kv.k, kv.v, kv.table, fb.pos, fb.packed, fb.mode.prompt)
        out = out.transpose(1, 2).reshape(b, t, -1)
        if fb.tree is not None:  # back to the nodes
            out = out.flatten(0, 1)[fb.tree.first][None]
        return self.wo(out, fb.mode, residual)


class FeedForward(nn.Module):
    def __init__(self, sd: dict[str, torch.Tensor], p: str, tp: TensorParallel = SOLO):
        super().__init__()
        names = [p + "gate_proj", p + "up_proj"]  # this rank's slice of each, side by side
        self.gate_up = Linear(torch.cat([sd[n + ".weight"] for n in names]), concat_bias(sd, names))
        self.down = RowParallelLinear(sd[p + "down_proj.weight"], sd.get(p + "down_proj.bias"), tp)

    def forward(self, x: torch.Tensor, mode: Mode, residual: torch.Tensor,
                handover: Handover | None = None) -> torch.Tensor:
        """residual + feed_forward(x), the residual added by the down projection. handover: what the norm computed
        of x for gate_up; swiglu hands the down projection its own (kernels.Handover)."""
        gate, up = self.gate_up(x, mode, handover=handover).chunk(2, dim=-1)
        request = self.down.request(mode, gate.numel() // gate.shape[-1], gate.device)
        h, h_handover = swiglu_handover(gate, up, request)
        return self.down(h, mode, residual, handover=h_handover)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, sd: dict[str, torch.Tensor], i: int, tp: TensorParallel = SOLO):
        super().__init__()
        p = f"model.layers.{i}."
        self.attention_norm = RMSNorm(sd[p + "input_layernorm.weight"], cfg.norm_eps)
        self.attention = Attention(cfg, sd, p + "self_attn.", tp)
        self.ffn_norm = RMSNorm(sd[p + "post_attention_layernorm.weight"], cfg.norm_eps)
        self.feed_forward = FeedForward(sd, p + "mlp.", tp)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, layer: int) -> torch.Tensor:
        h, handover = self.attention_norm.handover(x, self.attention.wqkv, fb.mode)
        x = self.attention(h, fb, layer, residual=x, handover=handover)
        h, handover = self.ffn_norm.handover(x, self.feed_forward.gate_up, fb.mode)
        return self.feed_forward(h, fb.mode, residual=x, handover=handover)


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], scaled as the config's rope_scaling says (transformers' formulas)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "dynamic":  # NTK scaling starts past max_position_embeddings, which is where our context ends
        return inv
    if kind == "yarn":
        return yarn_frequencies(inv, rs, cfg.rope_theta, hd)
    if kind == "linear":
        return inv / rs["factor"]
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        return torch.where(is_mid, mid, scaled)
    raise SelfspecError(f"unsupported rope scaling '{kind}'; supported: dynamic, linear, llama3, yarn")


def yarn_frequencies(inv: torch.Tensor, rs: dict, theta: float, hd: int) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated (divided
    by the factor), those that turn more than beta_fast times are kept, with a linear ramp between."""
    factor, old_ctx = rs["factor"], rs["original_max_position_embeddings"]

    def dim_of(turns: float) -> float:  # the (fractional) frequency index that turns `turns` times over old_ctx
        return hd * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(rs.get("beta_fast") or 32), dim_of(rs.get("beta_slow") or 1)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    ramp = ((torch.arange(hd // 2, dtype=torch.float64) - low) / (high - low or 0.001)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """YaRN scales cos and sin (so every attention logit) by this; 1 for the other types."""
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type") != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        return rs["attention_factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = rs["factor"], rs.get("mscale"), rs.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


class Runner(Protocol):
    """What runs the forward passes of a round: a Transformer, or one replaying its decode passes as CUDA graphs
    (engine/graphs.py: GraphedModel, the serving engine's PagedGraphedModel)."""
    cfg: ModelConfig

    @property
    def device(self) -> torch.device: ...

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, cache, mode: Mode,
                 logits_at: torch.Tensor | None = None, packed: Packed | None = None) -> torch.Tensor: ...


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, sd: dict[str, torch.Tensor], tp: TensorParallel = SOLO):
        """`sd`: HF-named weights; under tensor parallelism (`tp`), this rank's shard of them (parallel/shard.py):
        its heads, FFN slice and vocabulary rows. `cfg` stays the whole model's."""
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.embed = nn.Parameter(sd["model.embed_tokens.weight"], requires_grad=False)
        self.vocab_start = tp.rank * self.embed.shape[0]  # the first token id of this rank's embedding rows
        self.layers = nn.ModuleList(Block(cfg, sd, i, tp) for i in range(cfg.n_layers))
        self.norm = RMSNorm(sd["model.norm.weight"], cfg.norm_eps)
        head = sd.get("lm_head.weight")
        # Tied embeddings: the head is the embedding tensor itself, not a copy.
        self.tied = head is None or cfg.tie_embeddings
        self.lm_head = DenseWeight(self.embed.data if self.tied else head)
        angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), rope_frequencies(cfg))
        emb = torch.cat((angles, angles), dim=-1)
        scale = rope_attention_factor(cfg)
        self.register_buffer("cos", (emb.cos() * scale).float(), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).float(), persistent=False)
        self.kv_format, self.kv_group = "bf16", 128  # the KV cache new_cache builds (set_kv_format)
        # The head's rows of the draft vocabulary and their token ids (set_draft_vocab): what a draft_vocab mode reads.
        self.draft_head: DenseWeight | None = None
        self.register_buffer("draft_ids", torch.empty(0, dtype=torch.long), persistent=False)

    def _apply(self, fn, *args, **kwargs):
        # .to()/.cuda() move parameters and buffers one by one, which would give the tied head its own copy.
        super()._apply(fn, *args, **kwargs)
        if self.tied:
            self.lm_head.weight = self.embed.data
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def quantize(self, storage: str, group_size: int = 128, rotate: bool = False) -> None:
        """Replace every block linear's weight by its stored format (the head stays dense); with `rotate`,
        stored Hadamard-rotated, one rotation matrix per block order shared by all (quant/rotation.py)."""
        rotations = {} if rotate else None
        for lin in self.linears():
            lin.weight = quantize_weight(lin.weight.weight, storage, group_size, rotations)

    def set_kv_format(self, fmt: str, group_size: int = 128) -> None:
        """The KV cache format `new_cache` builds: bf16 (the model's own precision), int8 or hier, quantized in
        groups of group_size tokens (cache/quant_kv.py)."""
        check_kv_format(fmt, group_size)
        self.kv_format, self.kv_group = fmt, group_size

    def set_draft_vocab(self, ids: list[int]) -> None:
        """Let modes with `draft_vocab` compute the logits of these tokens only: their head rows, copied (a copy of
        len(ids) / vocab of the head: `weight_bytes` counts it). As many ids as before are written in place (graphs
        captured on the old ones read the new)."""
        vocab = self.lm_head.weight.shape[0]
        if self.tp.size > 1:
            raise SelfspecError("a draft vocabulary would need a slice of each rank's vocabulary rows; under tensor "
                                "parallelism drop --draft-vocab")
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab:
            raise SelfspecError(f"a draft vocabulary holds distinct token ids in 0..{vocab - 1}, got {len(ids)} ids")
        ids = torch.tensor(sorted(ids), device=self.device)
        if self.draft_head is not None and len(ids) == len(self.draft_ids):
            self.draft_ids.copy_(ids)
            torch.index_select(self.lm_head.weight, 0, ids, out=self.draft_head.weight)
            return
        self.draft_ids = ids
        self.draft_head = DenseWeight(self.lm_head.weight[ids].clone())

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache | QuantKVCache:
        c = self.cfg
        heads = c.n_kv_heads // self.tp.size  # this rank's KV heads
        if self.kv_format == "bf16":
            return KVCache(c.n_layers, batch, heads, max_len, c.head_dim, self.dtype, self.device)
        return QuantKVCache(c.n_layers, batch, heads, max_len, c.head_dim, self.dtype, self.device,
                            self.kv_format, self.kv_group)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache, mode: Mode,
                logits_at: torch.Tensor | None = None, packed: Packed | None = None,
                tree: TreeLayout | None = None) -> torch.Tensor:
        """tokens [B, T] at positions pos [B, T] (each row its own; [T] when all rows share them)
        -> logits [B, T, vocab] (float32). With logits_at [R] (indices into the B * T tokens, row-major), the
        logits of those tokens only, [R, vocab]: a prefill needs its last position, and the head (a GEMM over the
        whole vocabulary) then runs on R rows instead of B * T. With `packed`, tokens and pos [1, N] hold the
        rows `packed` describes, and cache has one row per packed row. With `tree`, tokens and pos [1, N] are the
        nodes of token trees (TreeLayout), and cache has a row per branch."""
        hidden = self.hidden(tokens, pos, cache, mode, packed, tree)
        if logits_at is None:
            return self.logits(hidden, mode)
        if not len(logits_at):  # nothing asked (a prefill chunk that completes no prompt): no head pass
            return hidden.new_empty(0, self.lm_head.weight.shape[0] * self.tp.size, dtype=torch.float32)
        return self.logits(hidden.reshape(-1, hidden.shape[-1])[logits_at], mode)

    def hidden(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache, mode: Mode,
               packed: Packed | None = None, tree: TreeLayout | None = None) -> torch.Tensor:
        """The final-norm hidden states [B, T, dim]; writes the KV of every position into `cache` (at the layers
        the mode does not skip)."""
        x = self.embed_tokens(tokens)
        pos = pos.expand(tokens.shape)
        if tree is not None:  # attention's rows: the branches
            pos = pos[0][tree.rows]
        # A packed token's slot depends on its row's block table: found in the rows' layout. A tree's nodes sharing
        # their sequence's row go to its tails (each node once, written alike by every row holding it).
        if packed is not None:
            slots = packed.unpad(cache.slots(packed.pad(pos)))
        else:
            slots = cache.slots(pos if tree is None or tree.tails is None else tree.tails)
        fb = ForwardBatch(mode, pos, self.cos[pos], self.sin[pos], slots, cache, packed, tree)
        for i, layer in enumerate(self.layers):
            # A skipped layer writes no KV: only a draft skips, and its verify pass rewrites every layer's KV.
            if i not in mode.skip_layers:
                x = layer(x, fb, i)
        return self.norm(x)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings [B, T, dim]. Split by vocabulary: each rank looks up the tokens in its rows (zeros
        for the others') and the all-reduce adds one embedding to zeros, which is exact."""
        if self.tp.size == 1:
            return self.embed[tokens]
        local = tokens - self.vocab_start
        mine = (local >= 0) & (local < self.embed.shape[0])
        x = self.embed[local.clamp(0, self.embed.shape[0] - 1)]
        return self.tp.all_reduce(torch.where(mine[..., None], x, torch.zeros_like(x)))

    def logits(self, hidden: torch.Tensor, mode: Mode) -> torch.Tensor:
        """Float32 logits over the whole vocabulary: under tensor parallelism each rank's vocabulary slice, gathered
        in rank order, so every rank picks the same token. A draft_vocab mode computes the draft vocabulary's and
        gives the other tokens -inf."""
        if mode.draft_vocab:
            if self.draft_head is None:
                raise SelfspecError(f"mode '{mode.name}' reads the draft vocabulary, which this model was not given "
                                    "(Transformer.set_draft_vocab)")
            part = linear(hidden, self.draft_head, self.head_mode(mode), None).float()
            out = part.new_full((*part.shape[:-1], self.lm_head.weight.shape[0]), float("-inf"))
            return out.index_copy_(-1, self.draft_ids, part)
        return self.tp.gather_last(linear(hidden, self.lm_head, self.head_mode(mode), None).float())

    def head_mode(self, mode: Mode) -> Mode:
        """The head stays dense: it runs in the model's own precision unless the mode is a dense one."""
        if mode.dense:
            return mode
        return MODES["fp32" if self.dtype == torch.float32 else "bf16"]

    def weight_bytes(self) -> int:
        """Bytes of every distinct tensor the model holds (shared tensors counted once)."""
        seen, total = set(), 0
        for t in list(self.parameters()) + list(self.buffers(recurse=True)):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def prefill(model, tokens: list[int], cache, mode: Mode, start: int = 0, all_logits: bool = False) -> torch.Tensor:
    """Run one row's tokens at positions start.. through `model` (a Transformer, or anything called as one) in
    passes the cache takes (a quantized one: at most a group at a time), committing each: the logits of the last
    token [1, vocab], or with all_logits of every token [len(tokens), vocab]."""
    step, out = cache.max_pass, []
    for i in range(0, len(tokens), step):
        chunk = tokens[i:i + step]
        pos = torch.arange(start + i, start + i + len(chunk), device=model.device)
        last = i + step >= len(tokens)
        at = None if all_logits else torch.tensor([len(chunk) - 1] if last else [], dtype=torch.long,
                                                    device=model.device)
        logits = model(torch.tensor([chunk], device=model.device), pos, cache, mode, at)
        out.append(logits[0] if all_logits else logits)
        cache.commit(start + i + len(chunk))
    return torch.cat(out)
