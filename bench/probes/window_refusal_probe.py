# Session 19: the CUDA op's refusal of a window without attend_chunk segfaulted under pytest.
import faulthandler, math, sys
faulthandler.enable()
import torch, membar
ops = torch.ops.membar
g = torch.Generator().manual_seed(5)
def r(*s): return (torch.randn(*s, generator=g)).to(torch.bfloat16).cuda()
q=r(128,4,128); k=r(128,2,128); v=r(128,2,128); kp=r(5,128,2,128); vp=r(5,128,2,128)
ki=torch.tensor([0,1],dtype=torch.int32).cuda(); vi=torch.tensor([2,3],dtype=torch.int32).cuda()
args = (q,k,v,kp,ki,vp,vi, 256, 1/math.sqrt(128))
for name, a, kw in [("attend_chunk=False alone", (None, 128, False), dict(sliding_window=64)),
                    ("sparse", (torch.tensor([[0, 1]], dtype=torch.int32).cuda(), 128), dict(sliding_window=64)),
                    ("attend_chunk=False after sparse", (None, 128, False), dict(sliding_window=64)),
                    ("attend_chunk=False no window", (None, 128, False), {})]:
    print("call:", name, flush=True)
    try:
        out = ops.paged_attention_forward(*args, *a, **kw); torch.cuda.synchronize(); print("  no error", flush=True)
    except RuntimeError as e:
        print("  RuntimeError:", str(e)[:160], flush=True)
