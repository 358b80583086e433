"""The tensor-parallel group of one process and the collectives the model calls.

Deterministic all-reduce: each rank's partial sum is all-gathered, then every rank adds the N partials in rank
order (0, 1, ..., N-1) in float32 and rounds once to the partials' dtype. Every rank therefore holds identical
bits, whatever reduction algorithm (ring, tree) or backend (gloo, NCCL) would have chosen, and the reduction is
elementwise, so a row's result does not depend on the other rows or tokens of the pass. The guarantee, for a fixed
TP size N on a fixed machine: results are equal across runs, across ranks, and between autoregressive, speculative
and batched decoding (what the batch-invariant kernels give one GPU, TP keeps). They are NOT equal across TP sizes:
N=2 splits every output projection's sum into two partial sums rounded on their own, so TP2 logits are close to,
not equal to, TP1 logits.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# A collective that waits longer than this has lost a rank (a crashed worker): fail rather than hang.
TIMEOUT = timedelta(seconds=int(os.environ.get("SELFSPEC_TP_TIMEOUT", "600")))
IDLE_TIMEOUT = timedelta(days=365)


# Two GPUs' sums of at most this many elements (a decode or verify pass's hidden rows; a prefill chunk's may be
# larger) go through PeerAllReduce: one kernel instead of NCCL's all-gather and the adds.
PEER_ALL_REDUCE_NUMEL = 1 << 21

# Whether this process has joined a peer group before. Symmetric memory's rendezvous numbers its exchanges through
# the store per process, from 0: a process in its second group (a second tensor-parallel LLM in a notebook, the
# next test) looks for the exchange numbered after its first, which a fresh peer process never writes, and both
# wait forever (sessions 25 and 26, on two H200s). So only a group of processes that have not joined one before
# sums through peer memory; any other takes NCCL's path.
_joined_peer = False


def _all_fresh(store: dist.Store, rank: int, size: int) -> bool:
    """Whether no rank of the group has joined a peer group before (every rank gets the same answer)."""
    store.set(f"peer-fresh/{rank}", "0" if _joined_peer else "1")
    return all(store.get(f"peer-fresh/{r}") == b"1" for r in range(size))


class PeerAllReduce:
    """The sum of two GPUs' bf16 partials in one kernel that reads the peer's copy over NVLink (PyTorch's symmetric
    memory, one-shot: each rank adds both copies in rank order). For two parts this gives the bits of the
    all-gather path's float32 sum rounded once: where the exact sum of two bf16 values fits float32's 24 bits both
    round it once, and where it does not (exponents more than 16 apart) the smaller part is below half a bf16 ulp of
    the larger and both give the larger. A decode step's sums are latency, not bandwidth: NCCL's all-gather and the
    adds cost ~30 us each at batch 1 (H200), 65 a pass on the 8B shape."""

    def __init__(self, group: Any, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        global _joined_peer
        _joined_peer = True
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(PEER_ALL_REDUCE_NUMEL, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.bfloat16 and x.numel() <= PEER_ALL_REDUCE_NUMEL

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        local = self.buffer[:x.numel()].view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(local, x.contiguous(), "sum", self.group_name)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the group: rank of size, the process group of the tensors' collectives (gloo on the
    CPU, NCCL on GPUs), a gloo group for host objects (the step plan rank 0 broadcasts) and, on two GPUs, the
    peer-memory all-reduce of small sums."""
    rank: int = 0
    size: int = 1
    group: Any = None
    control: Any = None
    peer: PeerAllReduce | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, in rank order (module docstring); x itself when alone."""
        if self.size == 1:
            return x
        if self.peer is not None and self.peer.takes(x):
            return self.peer(x)
        parts = self._all_gather(x)
        total = parts[0].float()
        for part in parts[1:]:
            total += part  # in float32: the part is widened exactly, as part.float() would be, without its copy
        return total.to(x.dtype)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dim in rank order (the vocab-split head's logits)."""
        if self.size == 1:
            return x
        return self._all_gather(x).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x in rank order, gathered into one tensor (no copies out of NCCL's
        buffer into a list: a pass makes two of these a layer, and at batch 1 each kernel shows)."""
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # ranks along dim 0, as gloo wants it too
        dist.all_gather_into_tensor(out, x, group=self.group)
        return out.view(self.size, *x.shape)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's obj on every rank (pickled over the gloo control group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.control)
        return out


SOLO = TensorParallel()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, size: int, port: int, device: str) -> TensorParallel:
    """Join the group of `size` processes rendezvousing on 127.0.0.1:port (one host); NCCL where `device` is a GPU
    (this rank's: cuda:rank), else gloo."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=TIMEOUT)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=size, timeout=TIMEOUT)
    # The control group waits for rank 0's next request, which may come after any idle time.
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    # Every rank sees the same environment, so all take the peer path or none (SELFSPEC_TP_PEER=0: NCCL's alone).
    peer = (PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank))
            if cuda and size == 2 and os.environ.get("SELFSPEC_TP_PEER", "1") != "0" and _all_fresh(store, rank, size)
            else None)
    return TensorParallel(rank, size, dist.group.WORLD, control, peer)


def rank_device(device: str, rank: int) -> str:
    """Each rank's GPU is its own: cuda -> cuda:rank; a CPU stays a CPU."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
