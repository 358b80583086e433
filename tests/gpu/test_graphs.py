"""CUDA-graph replays give the eager forward's logits bit for bit, and the cache they write is the same."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from conftest import tiny_model  # noqa: E402
from selfspec.engine.graphs import GraphedModel  # noqa: E402
from selfspec.model import Transformer  # noqa: E402
from selfspec.quant.modes import MODES  # noqa: E402


@pytest.mark.parametrize("storage,modes", [("dense", ["bf16"]), ("planes", ["upper", "full", "w4a8"]),
                                           ("int4", ["w4a16", "w4a4"])])
def test_replay_equals_eager(storage, modes):
    cfg, sd, _ = tiny_model("qwen2", seed=3, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2)
    model = Transformer(cfg, {k: v.bfloat16() for k, v in sd.items()})
    model.quantize(storage, 32)
    model = model.cuda()
    gm = GraphedModel(model, max_len=64)
    torch.manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (2, 9), device="cuda")
    eager_cache, graph_cache = model.new_cache(64, 2), gm.new_cache(64, 2)
    for mode_name in modes:
        mode = MODES[mode_name]
        for cache, fwd in ((eager_cache, model), (graph_cache, gm)):
            fwd(prompt, torch.arange(9, device="cuda"), cache, mode)
        for step in range(4):  # the first call captures, the later ones replay with new inputs
            tok = torch.randint(0, cfg.vocab_size, (2, 3), device="cuda")
            pos = torch.stack((9 + step + torch.arange(3, device="cuda"), 20 + torch.arange(3, device="cuda")))
            want = model(tok, pos, eager_cache, mode).clone()
            got = gm(tok, pos, graph_cache, mode).clone()
            assert torch.equal(got, want), f"{mode_name} step {step}"
        assert torch.equal(graph_cache.k, eager_cache.k) and torch.equal(graph_cache.v, eager_cache.v)


def test_a_graphed_tree_pass_equals_eager_from_host_values_or_device_ones():
    """A node-packed tree pass over a sequence's own blocks, replayed: from TreeLayout.of's host values (one copy
    into the graph's buffer) and from a layout built on the device (read back) alike, the eager pass's logits."""
    from dataclasses import replace

    from selfspec.cache.paged import PagedKVCache, SharedTree, tree_view
    from selfspec.engine.graphs import PagedGraphedModel
    from selfspec.model import TreeLayout

    cfg, sd, _ = tiny_model("qwen2", seed=5, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2)
    model = Transformer(cfg, {k: v.bfloat16() for k, v in sd.items()}).cuda()
    cache = PagedKVCache(cfg.n_layers, 16, cfg.n_kv_heads, 16, cfg.head_dim, torch.bfloat16, "cuda")
    cache.k.normal_(), cache.v.normal_()
    cache.allocate("s", 40)
    cache.truncate("s", 20)
    cache.extend("s", 10)  # the nodes' positions 20..29
    runner = PagedGraphedModel(model, cache, 64)
    mode = MODES["bf16"]
    torch.manual_seed(1)
    branches = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (4, 2, 3)]
    layout, tokens, pos = TreeLayout.of([(7, 20, branches)], "cuda", True, 5)
    view = tree_view([SharedTree(cache, "s")], [(0, len(branches))])
    want = model(tokens[None], pos[None], view, mode, tree=layout).clone()
    runner(tokens[None], pos[None], view, mode, tree=layout)  # the first call captures
    for tree in (layout, replace(layout, host=None)):
        got = runner(tokens[None], pos[None], view, mode, tree=tree).clone()
        assert torch.equal(got, want)
