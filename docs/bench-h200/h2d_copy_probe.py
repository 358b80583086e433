"""A small index tensor copied to the GPU while the GPU is idle: from pageable memory (.to), from pinned memory
(non_blocking), and the cost of a CUDA event record + synchronize. Usage: python docs/bench-h200/h2d_copy_probe.py"""
import time, torch
from array import array

dev = torch.device("cuda", 0)
vals = list(range(40))
def old(): return torch.frombuffer(array("q", vals), dtype=torch.long).to(dev)

pin = torch.empty(1 << 14, dtype=torch.long, pin_memory=True)
def pinned_only():
    h = torch.frombuffer(array("q", vals), dtype=torch.long); s = pin[:len(vals)]; s.copy_(h)
    return torch.empty(len(vals), dtype=torch.long, device=dev).copy_(s, non_blocking=True)
def pinned_whole():
    h = torch.frombuffer(array("q", vals), dtype=torch.long); pin[:len(vals)].copy_(h)
    return pin[:len(vals)].to(dev, non_blocking=True)
ev = torch.cuda.Event()
def event_pair(): ev.record(); ev.synchronize()
def empty(): return torch.empty(40, dtype=torch.long, device=dev)
for name, fn in [("old .to", old), ("pinned, no events", pinned_only), ("pinned .to", pinned_whole), ("event record+sync", event_pair), ("empty", empty)]:
    for _ in range(50): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(200):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    ts.sort()
    print(f"{name:20s} median {ts[100]*1e6:7.1f} us  p90 {ts[180]*1e6:7.1f} us", flush=True)
