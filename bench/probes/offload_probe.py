# A diagnostic (bench/results/2026-12-01-h200-session5/offload_probe-a3dd987.txt): one chunk-recurrent
# step with offload, and after LIMIT seconds the Python stacks, the runtime client stats and the native
# stacks (cuda-gdb attached to this process). Usage: offload_probe.py MODEL TOKENS LIMIT [BLOCK]
import faulthandler, json, os, sys, threading, time
import torch
from membar.oomb import OOMBConfig, OOMBTrainer
from membar.oomb.presets import build_model

name, tokens, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
block = int(sys.argv[4]) if len(sys.argv) > 4 else 65536
model = build_model(name, dtype=torch.bfloat16, device=torch.device("cuda"), max_positions=tokens, seed=0)
model.train()
trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=4096, page_tokens=128, offload=True, checkpoint_layers=True,
                                        history_block_tokens=block))
trainer.reserve(tokens)
print("reserved", trainer.store._sizes, flush=True)

def killer():
    time.sleep(limit + 75)
    os._exit(4)

def watchdog():
    time.sleep(limit)
    print("WATCHDOG: stacks", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    threading.Thread(target=killer, daemon=True).start()
    import subprocess
    gdb = subprocess.run(["cuda-gdb", "-p", str(os.getpid()), "-batch", "-ex", "thread apply all bt 30"],
                         capture_output=True, text=True, timeout=60)
    lines = [l for l in gdb.stdout.splitlines() if l.startswith("#") or l.startswith("Thread")]
    interesting = [l for l in lines if "membar" in l or l.startswith("Thread") or "cu" in l.split(" in ")[-1][:12]]
    print("\n".join(interesting[:400]), flush=True)
    try:
        print(json.dumps(trainer.store.runtime.stats()["clients"]), flush=True)
    except Exception as error:
        print("stats failed", error, flush=True)
    os._exit(3)

threading.Thread(target=watchdog, daemon=True).start()
ids = torch.randint(0, 1000, (1, tokens))
for i in range(2):
    started = time.time()
    trainer.step(ids)
    torch.cuda.synchronize()
    s = trainer.stats
    print(f"{name} {tokens} block {block}: step {i} {time.time() - started:.1f} s moved {s['bytes_moved'] / 2**30:.2f} GiB "
          f"hits {s['prefetch_hits']} misses {s['prefetch_misses']} stall {s['stall_seconds']:.2f} s", flush=True)
os._exit(0)
