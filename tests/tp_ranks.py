"""What tests/test_parallel.py runs on each rank: importable by the spawned ranks without the test modules' imports
(transformers alone takes seconds per process)."""
import torch

from selfspec.model import Transformer
from selfspec.parallel import SOLO, shard_state_dict
from selfspec.quant.modes import MODES

GROUP = 16  # the tiny models' K (64, 128) split in two stays whole groups of 16
# (storage, rotate, modes): every stored format, each in the modes that read it (qspec's rotated INT4 included).
RUNS = [("dense", False, ["fp32"]), ("int8", False, ["w8a16", "w8a8"]), ("int4", True, ["w4a16", "w4a4"]),
        ("planes", False, ["full", "upper"])]


def stored_bytes(model: Transformer) -> int:
    """Bytes of the sharded tensors: the linears, the head and (untied) the embedding."""
    head = 0 if model.tied else model.lm_head.nbytes()
    return sum(lin.weight.nbytes() for lin in model.linears()) + head + model.embed.numel() * model.embed.element_size()


def logits_and_bytes(tp, models, tokens):
    """On one rank, for each (cfg, sd) of `models` and each stored format: its shard's stored bytes, and in each mode
    the logits of a prompt pass then of a 3-token pass that reads the cached KV."""
    out = []
    for cfg, sd in models:
        res = {}
        for storage, rotate, modes in RUNS:
            model = Transformer(cfg, shard_state_dict({k: v.clone() for k, v in sd.items()}, tp.rank, tp.size), tp)
            model.quantize(storage, GROUP, rotate)
            for name in modes:
                cache = model.new_cache(32)
                first = model(tokens[:, :8], torch.arange(8), cache, MODES[name])
                res[name] = torch.cat((first, model(tokens[:, 8:], torch.arange(8, 11), cache, MODES[name])), 1)
            res[storage] = stored_bytes(model)
        out.append(res)
    return out


def graphed_and_eager(tp, cfg, sd, tokens, storage, group, mode_names):
    """On one rank's GPU, for each mode: the logits of decode steps after an eager prompt pass, replayed from CUDA
    graphs (which hold the pass's collectives) and run eagerly on a cache of their own, step by step."""
    from selfspec.engine.graphs import GraphedModel

    device = torch.device("cuda", torch.cuda.current_device())
    model = Transformer(cfg, shard_state_dict({k: v.bfloat16() for k, v in sd.items()}, tp.rank, tp.size), tp)
    model.quantize(storage, group, False)
    model = model.to(device)
    graphed_model = GraphedModel(model, max_len=32)
    tokens = tokens.to(device)
    out = {}
    for name in mode_names:
        mode = MODES[name]
        graphed, eager = graphed_model.new_cache(32), model.new_cache(32)
        for cache in (graphed, eager):
            model(tokens[:, :8], torch.arange(8, device=device), cache, mode)
        steps = []
        for i in range(8, tokens.shape[1]):
            pos = torch.arange(i, i + 1, device=device)
            steps.append((graphed_model(tokens[:, i:i + 1], pos, graphed, mode).clone(),
                          model(tokens[:, i:i + 1], pos, eager, mode)))
        out[name] = [(g.cpu(), e.cpu()) for g, e in steps]
    graphed_model.release()  # before the group is left (comm.leave)
    return out


def collectives(tp, parts):
    """On one rank: all_reduce and gather_last of this rank's part."""
    x = parts[tp.rank]
    return tp.all_reduce(x), tp.gather_last(x)


def rows_of_rank(n, tp=SOLO):
    """A benchmark's `measure` in miniature: n rows naming the rank that made them."""
    return [(tp.rank, tp.size)] * n


def peer_and_gathered(tp, parts):
    """On one rank's GPU: the sum of the parts through the peer-memory all-reduce and through the all-gather."""
    from selfspec.parallel.comm import TensorParallel

    assert tp.peer is not None, "two GPUs sum small bf16 tensors through peer memory"
    x = parts[tp.rank].to(torch.device("cuda", torch.cuda.current_device()))
    gathered = TensorParallel(tp.rank, tp.size, tp.group, tp.control)
    return [(tp.all_reduce(x[:n]).cpu(), gathered.all_reduce(x[:n]).cpu()) for n in (1, 7, len(x))]
