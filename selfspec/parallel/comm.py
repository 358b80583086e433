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


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the group: rank of size, the process group of the tensors' collectives (gloo on the
    CPU, NCCL on GPUs) and a gloo group for host objects (the step plan rank 0 broadcasts)."""
    rank: int = 0
    size: int = 1
    group: Any = None
    control: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, in rank order (module docstring); x itself when alone."""
        if self.size == 1:
            return x
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
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=TIMEOUT)
    # The control group waits for rank 0's next request, which may come after any idle time.
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TensorParallel(rank, size, dist.group.WORLD, control)


def rank_device(device: str, rank: int) -> str:
    """Each rank's GPU is its own: cuda -> cuda:rank; a CPU stays a CPU."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
