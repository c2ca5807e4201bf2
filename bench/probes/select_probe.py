# Page selection on the GPU (Note [Page selection in PyTorch] in bindings/python/membar/attention.py):
# the CUDA page_select kernel (one CTA per query tile) against page_select_scores (PyTorch
# operations over the whole GPU), 7B shape (28 q heads, 4 kv heads, head_dim 128, bf16 queries,
# pages of 128 tokens), a 4096-token chunk, top-64, one tile per chunk and tiles of 128, at
# histories of 32K to 1M tokens; milliseconds per call (CUDA events, median of 20) and whether the
# selections agree. Usage: select_probe.py [OUT.json]
import json, sys
import torch
from membar import attention

device = torch.device("cuda")
generator = torch.Generator(device=device).manual_seed(0)
q = torch.randn(4096, 28, 128, device=device, generator=generator).to(torch.bfloat16)
rows = []


def timed(fn):
    times = []
    for _ in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[3:])[len(times[3:]) // 2], out


for history in (32768, 131072, 262144, 524288, 1048576):
    mean = torch.randn(history // 128, 4, 128, device=device, generator=generator)
    for tile in (4096, 128):
        kernel_ms, want = timed(lambda: attention.page_select(q, mean, top_k=64, query_tile_tokens=tile))
        torch_ms, got = timed(lambda: attention.page_select_scores(q, mean, 64, tile))
        differing_tiles = int((want != got).any(dim=1).sum())
        row = dict(history_tokens=history, query_tile_tokens=tile, kernel_ms=kernel_ms, pytorch_ms=torch_ms,
                   speedup=kernel_ms / torch_ms, tiles=int(want.shape[0]), differing_tiles=differing_tiles)
        rows.append(row)
        print(f"history {history:>8}  tile {tile:>5}: kernel {kernel_ms:8.3f} ms  pytorch {torch_ms:8.3f} ms  "
              f"({kernel_ms / torch_ms:6.1f}x)  tiles differing {differing_tiles}/{want.shape[0]}", flush=True)
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as out:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, out, indent=1)
