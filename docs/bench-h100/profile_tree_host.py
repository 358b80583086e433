import cProfile, pstats, sys
import torch
from pathlib import Path
from selfspec.bench.synthetic import synthetic_model
from selfspec.engine.graphs import GraphedModel
from selfspec.bench.traces import load, replay
from selfspec.bench.spec import decode_speed
from selfspec.quant.modes import MODES
gm = GraphedModel(synthetic_model("llama-3-8b", "planes"), max_len=1024 + 512)
rounds = load(Path(sys.argv[1])).tasks["humaneval"]
decode_speed(gm, MODES["full"], replay(rounds, None), 5, 1024, 256, warm_tokens=256)
pr = cProfile.Profile()
pr.enable()
out = decode_speed(gm, MODES["full"], replay(rounds, None), 5, 1024, 256, warm_tokens=8)
pr.disable()
print(out)
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
