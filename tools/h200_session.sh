#!/usr/bin/env bash
# The runtime's measurements on a lent H200 (issue "One memory system"), in steps that fit
# 10-minute device calls on one warm machine (the build stays between calls while it is warm):
#
#   tools/h200_session.sh STEP...
#
# Give it MEMBAR_COMMIT (the commit whose files the device runs: its copy of .git can be older than
# the files, session 17); every bench writes it into its results. tools/device_tree.sh prepares a
# call (the dependency bundle, the committed tree of HEAD in .deps) and prints its command line.
#
#   build     CUDA build (tools/gpu_check.sh's build stage, sm_90a)
#   tests     gpu-labelled C++ tests and gpu-marked Python tests
#   probe     7B at 32K with offload through the embedded runtime, two steps (bench/probes/offload_probe.py:
#             stacks after PROBE_LIMIT seconds, default 150, if it hangs)
#   plain     7B shape: the runtime against plain tensors (bench/plain_store.py) in one run: dense
#             32K and 128K, sparse 256K; dense-offload at 32K (GPU peak) and 128K
#   offload   7B at 256K: dense-offload, the same with a LoGRA r=64 update (both methods, one runtime)
#   daemon    through membard (CUDA backend): dense 32K and dense-offload 128K, embedded beside them
#   waits     7B dense-offload at 32K with host waits against GPU-side waits for enqueued copies
#             (Note [Enqueued tickets]; "+streamwait"), beside plain tensors, in one run
#   waits-eager  the same GPU-side waits with CUDA_MODULE_LOADING=EAGER (no lazy module loading, the
#             cause of the deadlock Note [Enqueued tickets] works around), beside host waits
#   depth     7B dense-offload at DEPTH_CONTEXT (default 128K) in the embedded runtime, pages copied in
#             2 (default), 4 and 8 accesses ahead with the GPU budget grown to match: does a deeper
#             pipeline take away the host's wait for frames that releases free? (one run)
#   peak      7B dense-offload at 32K with the loss computed 4096, 1024 and 512 (default) tokens at a
#             time: GPU peak against the goal (<= 33.2 GiB) and the time it costs (one run)
#   gap       the in-process offload gap in one run: plain tensors, embedded dense-offload, prefetch
#             depth 4 and 8, loss pieces of 1024 and 512 tokens (GPU peak), at 32K and 128K
#   order     Note [Device-ordered copies]: gpu ctest, the runtime/OOMB gpu pytests, then embedded
#             dense-offload (copies ordered on the device, stream waits) against plain tensors and
#             against host order ("+hostorder", MEMBAR_DEVICE_ORDER=0) at 32K, and at 128K
#   order256  the same at 256K: embedded dense-offload against plain tensors (offload overhead goal
#             <= 3%), then sparse through the runtime against plain tensors as time allows
#   blocks256 7B at 256K: dense-offload with history blocks of 64K (default), 128K and 256K tokens
#             beside plain tensors, stream waits timed: do fewer, larger blocks take away the +4.5%?
#   waits256  7B at 256K: plain tensors, dense-offload and dense-offload with prefetch depth 4, both with
#             their stream waits timed per access kind and phase (stream_wait_by_kind in oomb_bench.json):
#             which accesses make the +4.5-6% at 256K, and does a deeper pipeline take it away?
#   streamed256  7B at 256K: plain tensors read in one call, plain tensors read in history blocks as
#             offloaded pages are ("+streamed": no copy, no wait) and dense-offload (waits timed), in one
#             run: how much of the offload gap is the blocks' compute, how much the runtime
#   reuse     7B at 32K and 128K: stage 2 taking stage 1's attention outputs ("+reuse", Note [Stage 1's
#             attention in stage 2]) against recomputing them, plain tensors and dense-offload, one run
#   profile   7B at PROFILE_CONTEXT (128K): plain tensors read in blocks ("+streamed") and dense-offload under
#             torch.profiler (device activity): busiest kernels and each stream's busy and idle time
#             (tools/trace_streams.py): are the offloaded step's kernels slower, or is its stream idle?
#             Then bench/probes/maps_probe.py: GPU map calls per frame placement in a small offloaded step
#   displace  7B dense-offload at 64K (history blocks of 16K: 256K's pattern at a quarter of the cost) and
#             128K with the engine's displace_rank 0 (default) and "all" beside plain tensors read in
#             blocks, in one run: map calls, fence waits, the runtime calls' host time split and bytes
#             moved against step time (Note [Eviction order]); then bench/probes/maps_probe.py with
#             ranks 0 and all
#   asyncmaps the client's mapping thread (Note [Maps off the caller's thread]): test_cuda_mapper, then 7B
#             dense-offload at 64K (blocks of 16K) with maps on the receiving thread (default) and on the
#             mapping thread ("+asyncmaps"), each also with displace_rank all, beside plain tensors read in
#             blocks, in one run (ASYNC_CONTEXTS / ASYNC_VARIANTS for others)
#   predict   7B sparse-offload at 256K, one selection per chunk: stage 1's selections guessed from the
#             chunk before and copied ahead (default, Note [Predicted selections]) against "+nopredict"
#   sparsedaemon  the same sparse-offload step (guesses on) embedded and through a membard started for
#             it, one run each (issue 11's ratio through membard)
#   defer     the embedded engine handing its copies over on its dispatcher thread (the default, Note
#             [Hand-over on the dispatcher]) against the trainer's thread ("+nodefersubmit"), 7B DEFER_KIND
#             (sparse-offload; or dense-offload) at DEFER_CONTEXT (256K), one process, then the sparse
#             step through a membard (DEFER_DAEMON=0 skips it)
#   chunkearly  7B dense-offload at CHUNKEARLY_CONTEXT (64K, blocks of 16K) with a chunk's own dK/dV pages
#             named by its layer's last dK/dV step (the default) against their own step only ("+nochunkearly")
#   sparseorder  7B sparse-offload at 256K through a membard first, then embedded with copies ordered on the
#             host ("+hostorder") and on the device (the embedded default), one process: why membard was faster
#   asyncdepth  the mapping thread with the lookahead 4 and 8 accesses ahead ("+asyncmaps+depth4/8") against
#             depth 4 alone and the default, 7B dense-offload at 64K (blocks of 16K), plain tensors beside
#   gpuwait   the stream's own wait for pages, timed with CUDA events ("+timewaits", MEMBAR_TIME_STREAM_WAITS=1;
#             oomb_bench.json has them per access kind and phase: stream_wait_by_kind),
#             embedded dense-offload at 32K and 128K beside plain tensors and the untimed run (the
#             issue's stall goal: <= 1% of the step)
#   trainer   examples/hf_trainer_oomb/train.py on the GPU (ecosystem issue: the same code at 64K+):
#             Hugging Face Trainer and TRL's SFTTrainer, the 1.5B shape (random init), 64K tokens,
#             chunks of 4096, bf16, --offload, 4 optimizer steps each
#   heads     attention kernels at every head size (64, 96, 128, 256) in bf16 and fp16 against SDPA
#             flash, 32K history (bench/attention_bench.py; model-coverage issue: fwd >= 1.0x, bwd >= 0.8x);
#             HEADS_DIMS / HEADS_DTYPES narrow it, HEADS_SOFTCAP=50 also times the soft-capped kernels (Gemma 2)
#   attention the paged kernels against SDPA flash at 32K, 128K and 256K history (the Qwen2.5-7B
#             attention shape; the kernels issue's table), the sparse call, then every head size in
#             bf16 with the soft-capped kernels timed too (ATTENTION_HISTORIES, HEADS_DIMS, HEADS_DTYPES,
#             HEADS_SOFTCAP narrow or widen it)
#   wsforward the warp-specialised forward (Note [Warp-specialised forward], wgmma_ws_w12r64_k128_s2,
#             chosen on Hopper at head_dim 128 since session 29, 96 since 30, 64 since 31): its isolated check
#             against the reference (head sizes 64 and 96 apart, WSFORWARD_HEADS), then (if it passed) the
#             attention bench at ATTENTION_HISTORIES with WSFORWARD_TRY's layouts (default the warpgroup
#             forward it replaced) beside it, SDPA flash and the dense path's cuDNN forward, those head sizes
#             beside WSFORWARD_HEAD_TRY's layouts, and the gpu attention tests that run every compiled layout
#   backward  the warpgroup backward's checks (C++ gpu attention tests, test_attention_cuda.py) and the
#             attention bench at head sizes 64/96/128, with the GPU's clock and power sampled
#   wsbackward  the warp-specialised backward (Note [Warp-specialised backward], wgmma_ws_w12_k128, chosen
#             on Hopper at head_dim 128 since session 32): the gpu attention tests (every compiled layout
#             against the CPU reference; WSBACKWARD_CTEST narrows them by name), test_attention_cuda.py
#             (or WSBACKWARD_PYTEST_PATHS) with WSBACKWARD_LAYOUT asked for ($MEMBAR_CUDA_BACKWARD_LAYOUT;
#             WSBACKWARD_PYTEST=0 skips it), then the attention bench at ATTENTION_HISTORIES with WSBACKWARD_TRY's layouts (default
#             the warpgroup backward it replaced) beside the chosen backward, SDPA flash and the split
#             layout, in the sparse call too, with the GPU's clock and power sampled
#   bwdsplit  the backward kernel by kernel under torch.profiler (bench/probes/backward_kernels_probe.py) at
#             BWDSPLIT_HISTORIES (131072 262144): default, deterministic, deterministic with the warpgroup dQ pass
#   ncu       Nsight Compute's counters of the chosen forward and backward at NCU_HISTORIES (32768 262144):
#             L2 hit rate, DRAM bytes, warp stalls by reason for the backward (bench/probes/attention_ncu_probe.py)
#   sparsebwd 7B sparse (top-64, pages on the GPU) at SPARSEBWD_CONTEXT (default 256K): membar's attention
#             backward on the chosen layout (the warpgroup one on Hopper) against the split mma.sync
#             one ("+splitbwd"), one run
#   models    the model-coverage table (bench/model_coverage_bench.py, issue "Train the models people
#             actually use"): COVERAGE_MODELS (default qwen3-8b; a comma list runs one process per model) at 32K and 128K
#             beside full-sequence training, and its bf16 gradient errors; COVERAGE_QUICK=1 runs the
#             four shapes' quick table instead (4 layers, 32K, < 5 minutes). COVERAGE_ARGS adds options
#             (e.g. "--parts timing --contexts 128K --variants chunk-recurrent": the row's missing
#             step alone), COVERAGE_MERGE names an earlier model_coverage.json to merge the rows into
#   softcap   Gemma-2-9B shape, 4 layers, 32K, chunk-recurrent step: its soft-capped global layers on the
#             paged kernels (Note [Soft-capped scores]) against the PyTorch path (MEMBAR_CUDA_SOFTCAP=0)
#   wintests  every gpu C++ test, then the Python attention tests and the model tests' bf16 gradient
#             errors (local layers on the windowed kernels, and on the PyTorch path)
#   window    Gemma-2-9B shape, 4 layers, 32K, chunk-recurrent step: its sliding-window layers on the paged
#             kernels (Note [Sliding window]) against the PyTorch path (MEMBAR_CUDA_WINDOW=0)
#   dp        7B at 32K: one process against data parallel with world size 1 (NCCL), in one run
#   cli       membar-train as a user runs it, 7B at CLI_SEQ (default 32K), 3 steps: embedded and
#             through membard (--socket), dense and --offload, in one call (steps 2-3 compared);
#             CLI_MODES="dense offload offload-streamwait" adds the embedded runtime with --offload
#             and MEMBAR_STREAM_WAIT=1 (its stream waits on the GPU for enqueued copies);
#             "offload-private" adds --offload --socket private (the run starts its own membard);
#             "sparse" and "sparse-offload" run --mode sparse (top-64) without and with --offload
#             (membard's pools: CLI_GPU_POOL, default 16GiB, and CLI_HOST_POOL, default 32GiB)
#   sparse1m  one whole sparse step (top-64, one selection per chunk) at SPARSE_CONTEXT (1M) of the 7B
#             shape through membard, layers' pages on the GPU as far as they fit, the rest in its host
#             pool (SPARSE_GPU_POOL 90GiB, SPARSE_HOST_POOL 96GiB): the issue's first whole 1M step
#   sparseblocks  7B sparse-offload (top-64, one selection per chunk) at SPARSE_BLOCKS_CONTEXTS (default
#             256K; 512K needs a call of its own), embedded: selections read in one call where they fit a block's room (default
#             since session 12) against block by block ("+blockwise"), in one run (Note [Streaming a
#             layer's history]: does a sparse chunk's cost stop growing with its history?)
#   growth    7B dense-offload at 128K and 256K in one run: GPU growth per 10K tokens where the
#             default GPU budget no longer grows with the sequence (from 64K on; the issue's goal:
#             <= 5 MB per 10K tokens; 32K -> 128K measures the budget's history block instead)
#   dense1m   the 1M dense partial step (stage 1 + the two longest stage-2 chunks) of the 7B shape
#             through membard (DENSE_GPU_POOL 90GiB, DENSE_HOST_POOL 96GiB), hybrid residency
#   share     two membar-train processes (1.5B shape, 32K, --offload) on one GPU through one membard
#             at once, beside one alone: each gets its share and the losses of the one alone
#   tp        several GPUs: membar-train, 7B shape at TP_SEQ (default 128K): one GPU, the heads split
#             over every GPU (--tensor-parallel N under torch.distributed.run, NCCL), data parallel
#             over every GPU, LoGRA on one GPU and over the split heads; TP_LONG=1 adds the split run
#             at N x TP_SEQ tokens with offload
#   select    page selection on the GPU: the CUDA kernel (one CTA per query tile) against PyTorch
#             operations (Note [Page selection in PyTorch]), 7B shape, 32K-1M history (bench/probes/select_probe.py)
#   wgsweep   the attention sweep module (kernels/sweep/) built, then bench/attention_sweep.py at 32K and
#             128K on the warpgroup forward layouts (with the experimental wgmma_w8r64_k64_s3_overlap:
#             Note [Softmax beside the next block's scores]) and the shipped warpgroup backward beside the
#             split layout it replaced on Hopper (SWEEP_FORWARD / SWEEP_BACKWARD for others); each experimental
#             layout is checked against the shipped kernels before it is timed
#   enqueue   bench/probes/enqueue_probe.py: host time of each cudaMemcpyAsync in bursts of 2, 8 and 64 MiB
#             host-to-GPU copies (4 GiB each): does handing copies to a stream block once it holds
#             enough queued work (the offloaded step's "enqueue" time, session 16)?
#   handoff   Note [Copies handed over in one call]: the gpu ctest but attention's, runtime_bench --quick
#             (its (d): host us per copy handed over, cudaMemcpyBatchAsync against one call per copy), then
#             7B dense-offload at HANDOFF_CONTEXTS (128K) with batched hand-off (default) and one call per
#             copy ("+copyeach", MEMBAR_BATCH_COPIES=0), with CUDA events for completion ("+copyevents") and
#             with maps in runs ("+mapruns", MEMBAR_DEFER_MAPS=1: Note [Maps in runs]) beside plain tensors
#             read in blocks, one run
#   hostpool  membard --gpu-pool 100GiB --host-pool 100GiB under ulimit -n 1024: time to serve,
#             time until the host pool is pinned, open descriptors
#
# Logs and results go to $OUT (or bench/results/latest): one folder per step, packed into
# $OUT/session-<steps>.tgz at the end (the device returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-python3}
out=${OUT:-$root/bench/results/latest}
work=/tmp/membar-session
# A fresh folder per call: a warm machine keeps /tmp between calls, and an earlier call's files
# (a saved checkpoint) once made every later archive too large to come back.
rm -rf "$work"
mkdir -p "$work" "$out"
export PYTHONPATH=$root/bindings/python PYTHONUNBUFFERED=1
log() { printf '[h200 %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
bin=$root/build-gpu/bin
status=0
steps_name=$(IFS=-; echo "$*")
pack() {   # the machine, then every step's files packed into $OUT (also when a time limit stops the call)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$work/machine.txt" 2>&1
  echo "commit: ${MEMBAR_COMMIT:-unknown}" >> "$work/machine.txt"
  # Files under 50 MB only (the device returns small files): logs, JSON, tables.
  (cd "$work" && find . -type f -size -50M ! -name '*.so' -print0 \
    | tar czf "$out/session-$steps_name.tgz" --null -T - 2>/dev/null)
}
# Run it under `timeout N tools/h200_session.sh ...` with N a minute below the call's limit (540 for
# 600): the steps done (and the one cut) still come back once the cut step's processes have exited
# (session 18: at 580 a membar-train cut mid-step outlived the call and nothing came back).
trap 'log "stopped by a signal: packing what ran"; pack; exit 124' TERM INT

bench() {   # bench STEP ARGS...: bench/oomb_bench.py at the 7B shape into $work/STEP
  local step=$1; shift
  mkdir -p "$work/$step"
  MEMBAR_RESULTS_DIR=$work/$step timeout "${BENCH_TIMEOUT:-570}" "$py" bench/oomb_bench.py --model qwen2.5-7b --time-limit 400 "$@" \
    > "$work/$step/bench.log" 2>&1 || status=1
  grep -vE '^\[|^ +' "$work/$step/oomb_bench.txt" 2>/dev/null || tail -20 "$work/$step/bench.log"
  grep '^\[oomb\]' "$work/$step/bench.log" 2>/dev/null | tail -2
}

gemma_kernels_or_pytorch() {   # STEP VARIABLE WHAT: Gemma 2's quick 32K step with VARIABLE=1, then =0
  local step=$1 variable=$2 what=$3 on
  for on in 1 0; do
    mkdir -p "$work/$step/kernels$on"
    env "$variable=$on" MEMBAR_RESULTS_DIR="$work/$step/kernels$on" timeout 120 "$py" bench/model_coverage_bench.py \
      --quick --models gemma-2-9b --parts timing --variants chunk-recurrent --fresh --time-budget 100 \
      > "$work/$step/kernels$on/bench.log" 2>&1 || status=1
    log "$what: $on"
    tail -2 "$work/$step/kernels$on/model_coverage.md" 2>/dev/null || tail -5 "$work/$step/kernels$on/bench.log"
  done
}

sparse_offload_through_membard() {   # STEP CONTEXT: 7B sparse-offload (top-64, waits timed) through a membard
  local step=$1 context=$2 socket=/tmp/membar-sparse.sock    # of the predict step's pools, started and stopped here
  start_daemon "$socket" --gpu-pool "${PREDICT_GPU_POOL:-24GiB}" --host-pool "${PREDICT_HOST_POOL:-64GiB}" \
    || { status=1; return; }
  MEMBAR_SOCKET=$socket bench "$step" --contexts "$context" --time-budget 200 --time-limit 200 --query-tile 4096 \
    --variants sparse-offload+timewaits
  "$py" tools/waits_summary.py "$work/$step/oomb_bench.json"
  kill "$daemon"; wait "$daemon" 2>/dev/null
}

clocks_start() {   # clocks_start FILE: the GPU's SM clock, power and temperature every 200 ms until clocks_stop
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 200 > "$1" 2>&1 &
  clocks=$!
}
clocks_stop() { kill "$clocks" 2>/dev/null; wait "$clocks" 2>/dev/null; }

start_daemon() {   # start_daemon SOCKET ARGS...: membard on the CUDA backend, waits for its socket
  local socket=$1; shift
  rm -f "$socket"
  "$bin/membard" --backend cuda --socket "$socket" --log-level warn "$@" > "$work/membard.log" 2>&1 &
  daemon=$!
  for _ in $(seq 600); do [ -S "$socket" ] && return 0; sleep 0.05; done
  log "membard did not start"; cat "$work/membard.log"; return 1
}

for step in "$@"; do
  log "step $step"
  case $step in
    build)
      GPU_CHECK_STAGES=build MEMBAR_RESULTS_DIR=$work/build OUT= tools/gpu_check.sh > "$work/build.log" 2>&1 \
        || { status=1; tail -40 "$work/build.log"; }
      ls -la bindings/python/membar/_C.so "$bin/membard" 2>&1 | sed 's/^/  /' ;;
    tests)   # GPU_CTEST=0 skips the C++ gpu tests; PYTEST_PATHS narrows the Python ones (default tests/python)
      mkdir -p "$work/tests"
      if [ "${GPU_CTEST:-1}" != 0 ]; then
        ctest --test-dir build-gpu -L gpu --output-on-failure --timeout 300 > "$work/tests/gpu_ctest.log" 2>&1 || status=1
        tail -6 "$work/tests/gpu_ctest.log"
      fi
      timeout ${PYTEST_TIMEOUT:-420} "$py" -m pytest -q -m gpu ${PYTEST_PATHS:-tests/python} -p no:cacheprovider --durations=15 \
        > "$work/tests/gpu_pytest.log" 2>&1 || status=1
      tail -25 "$work/tests/gpu_pytest.log" ;;
    probe)
      mkdir -p "$work/probe"
      timeout 300 "$py" bench/probes/offload_probe.py qwen2.5-7b 32768 "${PROBE_LIMIT:-150}" \
        > "$work/probe/offload_probe.txt" 2>&1 || status=1
      grep -vE '^ +File|^  ' "$work/probe/offload_probe.txt" | tail -25 ;;
    plain)
      bench plain --contexts "${PLAIN_CONTEXTS:-32K,128K,256K}" --time-budget "${PLAIN_BUDGET:-540}" \
        --variants "${PLAIN_VARIANTS:-dense+plain:32K/128K,dense:32K/128K,dense-offload:32K/128K,sparse+plain:256K,sparse:256K}" ;;
    waits)
      bench waits --contexts 32K --time-budget 400 --time-limit 150 \
        --variants "dense+plain,dense-offload,dense-offload+streamwait" ;;
    waits-eager)
      CUDA_MODULE_LOADING=EAGER bench waits-eager --contexts 32K --time-budget 400 --time-limit 150 \
        --variants "dense-offload,dense-offload+streamwait" ;;
    depth)
      bench depth --contexts "${DEPTH_CONTEXT:-128K}" --time-budget 540 \
        --variants "dense-offload,dense-offload+depth4,dense-offload+depth8" ;;
    peak)
      bench peak --contexts 32K --time-budget 300 --variants "dense-offload+piece4096,dense-offload+piece1024,dense-offload" ;;
    gap)
      bench gap --contexts 32K,128K --time-budget "${GAP_BUDGET:-420}" \
        --variants "dense+plain:32K/128K,dense-offload:32K/128K,dense-offload+depth4:32K/128K,dense-offload+depth8:32K,dense-offload+piece1024:32K,dense-offload+piece512:32K" ;;
    order)
      mkdir -p "$work/order"
      ctest --test-dir build-gpu -L gpu --output-on-failure --timeout 120 > "$work/order/gpu_ctest.log" 2>&1 || status=1
      tail -4 "$work/order/gpu_ctest.log"; grep -E "Failed|\*\*\*" "$work/order/gpu_ctest.log" | head -10
      timeout 200 "$py" -m pytest -q -x -m gpu tests/python/test_oomb.py tests/python/test_runtime_gpu.py -p no:cacheprovider \
        > "$work/order/gpu_pytest.log" 2>&1 || status=1
      tail -4 "$work/order/gpu_pytest.log"
      bench order --contexts 32K,128K --time-budget "${ORDER_BUDGET:-330}" \
        --variants "dense+plain:32K/128K,dense-offload:32K/128K,dense-offload+hostorder:32K" ;;
    order256)
      bench order256 --contexts 256K --time-budget "${ORDER_BUDGET:-420}" \
        --variants "dense+plain,dense-offload,sparse+plain,sparse" ;;
    blocks256)
      bench blocks256 --contexts 256K --time-budget "${BLOCKS_BUDGET:-560}" --time-limit 240 \
        --variants "dense+plain,dense-offload+timewaits,dense-offload+timewaits@128K,dense-offload+timewaits@256K" ;;
    waits256)
      bench waits256 --contexts 256K --time-budget "${WAITS_BUDGET:-560}" --time-limit 240 \
        --variants "dense+plain,dense-offload+timewaits,dense-offload+depth4+timewaits"
      "$py" tools/waits_summary.py "$work/waits256/oomb_bench.json" ;;
    streamed256)
      bench streamed256 --contexts 256K --time-budget "${STREAMED_BUDGET:-560}" --time-limit 240 \
        --variants "${STREAMED_VARIANTS:-dense+plain+streamed,dense-offload+timewaits,dense+plain}"
      "$py" tools/waits_summary.py "$work/streamed256/oomb_bench.json" ;;
    reuse)
      bench reuse --contexts "${REUSE_CONTEXTS:-32K,128K}" --time-budget "${REUSE_BUDGET:-540}" \
        --variants "${REUSE_VARIANTS:-dense+plain:32K/128K,dense+plain+reuse:32K/128K,dense-offload:128K,dense-offload+reuse:128K}" ;;
    profile)
      bench profile --contexts "${PROFILE_CONTEXT:-128K}" --time-budget "${PROFILE_BUDGET:-420}" --time-limit 240 \
        --variants "${PROFILE_VARIANTS:-dense+plain+streamed+profile,dense-offload+profile}"
      for file in "$work"/profile/profile-*.txt; do echo "== $file"; grep -E '^stream|^  gap' "$file"; done
      "$py" -c "import json, sys; [print(r['variant'], r.get('step_seconds'), 'stage2', r.get('stage2_seconds'),
        'store host s', r.get('store_host_seconds'), 'gpu maps', r.get('gpu_maps'))
        for r in json.load(open(sys.argv[1]))['results']]" "$work/profile/oomb_bench.json"
      timeout 120 "$py" bench/probes/maps_probe.py > "$work/profile/maps_probe.txt" 2>&1 || status=1
      tail -3 "$work/profile/maps_probe.txt" ;;
    displace)
      # Note [Eviction order]'s displace_rank: the frame already mapped at a page's position serves it
      # when its occupant is among MIN's first N candidates (fewer map calls, some extra copies).
      bench displace --contexts "${DISPLACE_CONTEXTS:-64K,128K}" --time-budget "${DISPLACE_BUDGET:-420}" --time-limit 200 \
        --variants "${DISPLACE_VARIANTS:-dense+plain+streamed@16K:64K,dense-offload@16K:64K,dense-offload+displaceall@16K:64K,dense+plain+streamed:128K,dense-offload:128K,dense-offload+displaceall:128K}"
      "$py" tools/waits_summary.py "$work/displace/oomb_bench.json"
      for rank in 0 all; do
        MEMBAR_DISPLACE_RANK=$rank timeout 90 "$py" bench/probes/maps_probe.py > "$work/displace/maps_probe-$rank.txt" 2>&1 || status=1
        echo "displace_rank $rank: $(tail -1 "$work/displace/maps_probe-$rank.txt")"
      done ;;
    asyncmaps)
      # Note [Maps off the caller's thread]: frames mapped on the client's mapping thread (default)
      # against on the thread that receives the events ("+syncmaps"), beside plain tensors read in blocks.
      "$bin/test_cuda_mapper" > "$work/asyncmaps-mapper.log" 2>&1 || status=1
      tail -3 "$work/asyncmaps-mapper.log"
      bench asyncmaps --contexts "${ASYNC_CONTEXTS:-64K}" --time-budget "${ASYNC_BUDGET:-420}" --time-limit 200 \
        --variants "${ASYNC_VARIANTS:-dense+plain+streamed@16K:64K,dense-offload@16K:64K,dense-offload+asyncmaps@16K:64K,dense-offload+displaceall@16K:64K,dense-offload+displaceall+asyncmaps@16K:64K}"
      "$py" tools/waits_summary.py "$work/asyncmaps/oomb_bench.json" ;;
    handoff)
      mkdir -p "$work/handoff"
      if [ "${HANDOFF_CTEST:-1}" = 1 ]; then
        ctest --test-dir build-gpu -L gpu -E "Attention|attention" --output-on-failure --timeout 200 \
          > "$work/handoff/gpu_ctest.log" 2>&1 || status=1
        tail -4 "$work/handoff/gpu_ctest.log"
      fi
      MEMBAR_RESULTS_DIR=$work/handoff timeout 240 "$bin/runtime_bench" --quick > "$work/handoff/runtime_bench.log" 2>&1 \
        || status=1
      grep '^\[handoff\]' "$work/handoff/runtime_bench.log"
      bench handoff --contexts "${HANDOFF_CONTEXTS:-128K}" --time-budget "${HANDOFF_BUDGET:-330}" --time-limit 200 \
        --variants "${HANDOFF_VARIANTS:-dense+plain+streamed,dense-offload,dense-offload+mapruns,dense-offload+copyeach,dense-offload+copyevents}"
      "$py" tools/waits_summary.py "$work/handoff/oomb_bench.json" ;;
    staged)
      # Note [Staged history]: offloaded history blocks copied through staging rows (+staged)
      # against blocks acquired as the history's own pages (the default), beside plain tensors;
      # first the staged-copies gpu test and the runtime store's gpu tests.
      mkdir -p "$work/staged"
      "$bin/test_cuda_client_integrity" --gtest_filter="*Staged*:*Embedded*" > "$work/staged/client_integrity.log" 2>&1 || status=1
      tail -3 "$work/staged/client_integrity.log"
      MEMBAR_STAGED_HISTORY=1 timeout ${PYTEST_TIMEOUT:-200} "$py" -m pytest -q -m gpu tests/python/test_oomb.py \
        tests/python/test_runtime_gpu.py -p no:cacheprovider > "$work/staged/gpu_pytest.log" 2>&1 || status=1
      tail -3 "$work/staged/gpu_pytest.log"
      bench staged --contexts "${STAGED_CONTEXTS:-128K}" --time-budget "${STAGED_BUDGET:-400}" --time-limit 200 \
        --variants "${STAGED_VARIANTS:-dense+plain+streamed,dense-offload+staged,dense-offload+kvstaged,dense-offload}"
      "$py" tools/waits_summary.py "$work/staged/oomb_bench.json" ;;
    stagedsparse)
      # Sparse offload with its selections staged page by page (Note [Staged history]) against whole
      # frames acquired (the default): bytes moved, prefetch hits, step time, one call.
      # One selection per 4096-token chunk (--query-tile 4096), as sparseblocks and session 13's 80.2 s:
      # the default tiles of 128 queries select per tile (session 21: 193.4 s, 2,885 GiB moved).
      bench stagedsparse --contexts "${STAGED_CONTEXTS:-256K}" --time-budget "${STAGED_BUDGET:-420}" --time-limit 240 \
        --query-tile 4096 \
        --variants "${STAGED_VARIANTS:-sparse-offload,sparse-offload+staged}"
      "$py" tools/waits_summary.py "$work/stagedsparse/oomb_bench.json" ;;
    predict)
      # Note [Predicted selections]: sparse offload at 256K (one selection per chunk) with stage 1's
      # selections guessed from the chunk before and copied ahead (default) against without
      # ("+nopredict"): prefetch hits, bytes moved, step time, one run each in one call; first the
      # trainer's gpu tests (sparse offload changes no gradient bit with the guesses on).
      mkdir -p "$work/predict"
      timeout ${PYTEST_TIMEOUT:-150} "$py" -m pytest -q -m gpu tests/python/test_oomb.py -p no:cacheprovider \
        > "$work/predict/gpu_pytest.log" 2>&1 || status=1
      tail -3 "$work/predict/gpu_pytest.log"
      # PREDICT_DAEMON=1: through a membard started for it (the guesses then go over its ring as one
      # prefetch_ranges request each) instead of the embedded runtime.
      predict_socket=embedded
      if [ "${PREDICT_DAEMON:-0}" = 1 ]; then
        predict_socket=/tmp/membar-predict.sock
        start_daemon "$predict_socket" --gpu-pool "${PREDICT_GPU_POOL:-24GiB}" --host-pool "${PREDICT_HOST_POOL:-64GiB}" \
          || { status=1; continue; }
      fi
      MEMBAR_SOCKET=$predict_socket bench predict --contexts "${PREDICT_CONTEXTS:-256K}" --time-budget "${PREDICT_BUDGET:-300}" \
        --time-limit 200 --query-tile 4096 \
        --variants "${PREDICT_VARIANTS:-sparse-offload+timewaits,sparse-offload+nopredict+timewaits}"
      "$py" tools/waits_summary.py "$work/predict/oomb_bench.json"
      if [ "$predict_socket" != embedded ]; then
        "$bin/membarctl" --socket "$predict_socket" stats --json > "$work/predict/membarctl_stats.json" 2>&1
        kill "$daemon"; wait "$daemon" 2>/dev/null
      fi ;;
    sparsedaemon)
      # 7B sparse-offload at 256K (top-64, one selection per chunk, stage 1's guesses on) embedded and
      # through a membard started for it, one run each in one call: issue 11's membard ratio.
      for where in embedded membard; do
        socket=embedded
        if [ $where = membard ]; then
          socket=/tmp/membar-sparse.sock
          start_daemon "$socket" --gpu-pool "${PREDICT_GPU_POOL:-24GiB}" --host-pool "${PREDICT_HOST_POOL:-64GiB}" \
            || { status=1; continue; }
        fi
        MEMBAR_SOCKET=$socket bench "sparsedaemon/$where" --contexts "${PREDICT_CONTEXTS:-256K}" --time-budget 200 \
          --time-limit 200 --query-tile 4096 --variants sparse-offload+timewaits
        "$py" tools/waits_summary.py "$work/sparsedaemon/$where/oomb_bench.json"
        if [ $where = membard ]; then
          "$bin/membarctl" --socket "$socket" stats --json > "$work/sparsedaemon/membarctl_stats.json" 2>&1
          kill "$daemon"; wait "$daemon" 2>/dev/null
        fi
      done ;;
    defer)
      # Note [Hand-over on the dispatcher] (the embedded default since session 28) against the trainer's
      # thread handing copies over ("+nodefersubmit"), 7B DEFER_KIND (sparse-offload) at DEFER_CONTEXT
      # (256K), one process; then, for sparse-offload, the same step through a membard.
      c=${DEFER_CONTEXT:-256K}
      kind=${DEFER_KIND:-sparse-offload}
      MEMBAR_SOCKET=embedded bench defer --contexts "$c" --time-budget 400 --time-limit 200 --query-tile 4096 \
        --variants "$kind+timewaits,$kind+timewaits+nodefersubmit"
      "$py" tools/waits_summary.py "$work/defer/oomb_bench.json"
      if [ "${DEFER_DAEMON:-1}" = 1 ] && [ "$kind" = sparse-offload ]; then
        sparse_offload_through_membard defer/membard "$c"
      fi ;;
    chunkearly)
      # Note [Chunk grads with the last block] against its own step only ("+nochunkearly"): 7B
      # dense-offload at CHUNKEARLY_CONTEXT (64K, blocks of 16K: 256K's pattern), waits timed, one process.
      c=${CHUNKEARLY_CONTEXT:-64K}
      BENCH_TIMEOUT=${CHUNKEARLY_TIMEOUT:-570} bench chunkearly --contexts "$c" --time-budget 400 --time-limit 200 \
        --variants "dense-offload+timewaits+nochunkearly@16K:$c,dense-offload+timewaits@16K:$c"
      "$py" tools/waits_summary.py "$work/chunkearly/oomb_bench.json" ;;
    sparseorder)
      # Why the sparse-offload step at 256K ran faster through membard than embedded (session 27: 69.7 s
      # against 82.5 s; the embedded engine's calls held its lock 22.1 s against 4.7 s in membard):
      # membard first this time, then embedded with copies ordered on the host ("+hostorder", as
      # membard orders them) and on the device (the embedded default), one process.
      sparse_offload_through_membard sparseorder/membard 256K
      MEMBAR_SOCKET=embedded bench sparseorder/embedded --contexts 256K --time-budget 400 --time-limit 200 \
        --query-tile 4096 --variants sparse-offload+timewaits+hostorder,sparse-offload+timewaits
      "$py" tools/waits_summary.py "$work/sparseorder/embedded/oomb_bench.json" ;;
    asyncdepth)
      # The mapping thread with a deeper lookahead (it waited for most maps at depth 2, session 16):
      # "+depthN" also grows the default GPU budget to match, so compare against "+depth4" alone.
      bench asyncdepth --contexts "${ASYNC_CONTEXTS:-64K}" --time-budget "${ASYNC_BUDGET:-420}" --time-limit 200 \
        --variants "${ASYNC_VARIANTS:-dense+plain+streamed@16K:64K,dense-offload@16K:64K,dense-offload+depth4@16K:64K,dense-offload+asyncmaps+depth4@16K:64K,dense-offload+asyncmaps+depth8@16K:64K}"
      "$py" tools/waits_summary.py "$work/asyncdepth/oomb_bench.json" ;;
    gpuwait)
      bench gpuwait --contexts 32K,128K --time-budget "${GPUWAIT_BUDGET:-400}" \
        --variants "dense+plain:32K/128K,dense-offload+timewaits:32K/128K,dense-offload:32K" ;;
    trainer)
      mkdir -p "$work/trainer"
      # The device has no network: transformers' Trainer needs accelerate, carried as a wheel in
      # .deps/wheels (tools/make_gpu_deps.sh); SFTTrainer needs TRL and datasets (too large to carry:
      # skipped when missing).
      "$py" -c "import accelerate" 2>/dev/null || "$py" -m pip install -q --no-index --no-deps \
        --find-links .deps/wheels accelerate > "$work/trainer/pip.log" 2>&1
      kinds=hf; "$py" -c "import trl, datasets" 2>/dev/null && kinds="hf sft"
      for kind in $kinds; do
        MEMBAR_RESULTS_DIR=$work/trainer timeout 280 "$py" examples/hf_trainer_oomb/train.py --trainer $kind \
          --model "${TRAINER_MODEL:-qwen2.5-1.5b}" --seq-len "${TRAINER_SEQ:-65536}" --chunk 4096 --dtype bfloat16 \
          --steps 4 --offload --out "/tmp/membar-trainer-$kind" > "$work/trainer/$kind.log" 2>&1 || status=1
        tail -5 "$work/trainer/$kind.log"
        # The saved model stays on the device (GBs; the device returns small files only): list it.
        ls -la "/tmp/membar-trainer-$kind" > "$work/trainer/$kind-saved.txt" 2>&1
      done ;;
    heads)
      mkdir -p "$work/heads"
      MEMBAR_RESULTS_DIR=$work/heads timeout 300 "$py" bench/attention_bench.py --histories "" \
        --head-dims "${HEADS_DIMS:-64,96,128,256}" --head-dim-dtypes "${HEADS_DTYPES:-bfloat16,float16}" \
        --softcap "${HEADS_SOFTCAP:-0}" > "$work/heads/bench.log" 2>&1 || status=1
      tail -12 "$work/heads/attention.txt" 2>/dev/null || tail -20 "$work/heads/bench.log" ;;
    sparsebwd)
      bench sparsebwd --contexts "${SPARSEBWD_CONTEXT:-256K}" --variants "sparse,sparse+splitbwd" ;;
    attention)
      mkdir -p "$work/attention"
      clocks_start "$work/attention/clocks.csv"
      MEMBAR_RESULTS_DIR=$work/attention timeout 300 "$py" bench/attention_bench.py \
        --histories "${ATTENTION_HISTORIES:-32768,131072,262144}" --head-dims "${HEADS_DIMS:-64,96,128,256}" \
        --head-dim-dtypes "${HEADS_DTYPES:-bfloat16}" --softcap "${HEADS_SOFTCAP:-50}" \
        --try-backward-layouts "${TRY_BACKWARD:-64=w8_k128_split_s2_pad,96=w8_k128_dq64,256=w4_k64_dq32_pad_s2_d2}" \
        > "$work/attention/bench.log" 2>&1 || status=1
      clocks_stop
      cat "$work/attention/attention.txt" 2>/dev/null || tail -20 "$work/attention/bench.log"
      "$py" tools/clocks_summary.py "$work/attention/clocks.csv" ;;
    wsforward)
      # Note [Warp-specialised forward]: first its subprocess-isolated check against the float32
      # reference and the mma.sync layout (a hang or a fault fails one test), and only if that passes
      # the in-process tests that run every compiled layout (C++ gpu attention tests, the Python
      # variants) and the timing at 32K-256K beside the chosen layout, SDPA flash and the dense
      # path's cuDNN forward, and at the head sizes WSFORWARD_HEADS (64,96; 32K history) beside the
      # layouts WSFORWARD_HEAD_TRY names. WSFORWARD_ISOLATED128=0 skips the head-128 check (for a call
      # that changed only the other head sizes).
      mkdir -p "$work/wsforward"
      layout=wgmma_ws_w12r64_k128_s2
      isolated=0
      if [ "${WSFORWARD_ISOLATED128:-1}" = 1 ]; then
        timeout 300 "$py" -m pytest -x -q -s -m gpu tests/python/test_attention_wgmma.py -k "(ws_w12 and 16-128]) or ws_w12r64_k128_s2] or compiled_and_chosen" \
          -p no:cacheprovider > "$work/wsforward/isolated_pytest.log" 2>&1
        isolated=$?
        tail -8 "$work/wsforward/isolated_pytest.log"
      fi
      # The other head sizes (WSFORWARD_HEADS) are checked apart: their failure must not cost the 128 timing.
      heads=${WSFORWARD_HEADS:-64,96}
      others=$(echo "$heads" | sed 's/\([0-9]*\)/16-\1]/g; s/,/ or /g')
      timeout 200 "$py" -m pytest -x -q -s -m gpu tests/python/test_attention_wgmma.py -k "ws_w12 and ($others)" -p no:cacheprovider \
        > "$work/wsforward/isolated_heads_pytest.log" 2>&1 || { status=1; heads=""; }
      tail -4 "$work/wsforward/isolated_heads_pytest.log"
      if [ $isolated = 0 ]; then
        clocks_start "$work/wsforward/clocks.csv"
        MEMBAR_RESULTS_DIR=$work/wsforward timeout 240 "$py" bench/attention_bench.py \
          --histories "${ATTENTION_HISTORIES:-32768,131072,262144}" --try-dense-layouts "${WSFORWARD_TRY:-wgmma_w8r64_k128_s2}" \
          --head-dims "$heads" --head-dim-dtypes bfloat16 --try-layouts "${WSFORWARD_HEAD_TRY:-64=wgmma_w8r64_k64_s3_2cta,96=wgmma_w8r64_k128_s2}" \
          > "$work/wsforward/bench.log" 2>&1 || status=1
        clocks_stop
        cat "$work/wsforward/attention.txt" 2>/dev/null || tail -20 "$work/wsforward/bench.log"
        "$py" tools/clocks_summary.py "$work/wsforward/clocks.csv"
        ctest --test-dir build-gpu -L gpu -R "ttention" --output-on-failure --timeout 200 \
          > "$work/wsforward/gpu_ctest.log" 2>&1 || status=1
        tail -4 "$work/wsforward/gpu_ctest.log"; grep -E "Failed|\*\*\*" "$work/wsforward/gpu_ctest.log" | head -10
        timeout 200 "$py" -m pytest -q -m gpu tests/python/test_attention_variants.py -k "$layout" -p no:cacheprovider \
          > "$work/wsforward/variants_pytest.log" 2>&1 || status=1
        tail -4 "$work/wsforward/variants_pytest.log"
      else
        status=1
      fi ;;
    backward)
      # The warpgroup backward's checks and timing (session 31): the C++ gpu attention tests (every compiled layout
      # against the CPU reference: shapes, soft-caps, windows, sparse selections, deterministic
      # mode), the Python ops against the reference (BACKWARD_PYTEST_TIMEOUT), then the attention
      # bench at ATTENTION_HISTORIES and head sizes 64, 96 and 128 beside SDPA flash and the mma.sync
      # layouts (capped too).
      mkdir -p "$work/backward"
      ctest --test-dir build-gpu -L gpu -R ttention --output-on-failure --timeout 200 \
        > "$work/backward/gpu_ctest.log" 2>&1 || status=1
      tail -4 "$work/backward/gpu_ctest.log"; grep -E "Failed|\*\*\*" "$work/backward/gpu_ctest.log" | head -10
      timeout "${BACKWARD_PYTEST_TIMEOUT:-150}" "$py" -m pytest -q -m gpu tests/python/test_attention_cuda.py \
        -p no:cacheprovider > "$work/backward/pytest.log" 2>&1 || status=1
      tail -4 "$work/backward/pytest.log"
      clocks_start "$work/backward/clocks.csv"
      MEMBAR_RESULTS_DIR=$work/backward timeout 240 "$py" bench/attention_bench.py \
        --histories "${ATTENTION_HISTORIES:-32768,131072,262144}" --head-dims "${HEADS_DIMS:-64,96,128}" \
        --head-dim-dtypes bfloat16 --softcap "${HEADS_SOFTCAP:-50}" \
        --try-backward-layouts "${TRY_BACKWARD:-64=w8_k128_split_s2_pad,96=w8_k128_dq64}" \
        > "$work/backward/bench.log" 2>&1 || status=1
      clocks_stop
      cat "$work/backward/attention.txt" 2>/dev/null || tail -20 "$work/backward/bench.log"
      "$py" tools/clocks_summary.py "$work/backward/clocks.csv" ;;
    wsbackward)
      mkdir -p "$work/wsbackward"
      ctest --test-dir build-gpu -L gpu -R "${WSBACKWARD_CTEST:-ttention}" --output-on-failure --timeout 200 \
        > "$work/wsbackward/gpu_ctest.log" 2>&1 || status=1
      tail -4 "$work/wsbackward/gpu_ctest.log"; grep -E "Failed|\*\*\*|backward layout wgmma_ws" "$work/wsbackward/gpu_ctest.log" | sort | uniq -c | head -12
      if [ "${WSBACKWARD_PYTEST:-1}" = 1 ]; then
        MEMBAR_CUDA_BACKWARD_LAYOUT=${WSBACKWARD_LAYOUT:-wgmma_ws_w12_k128} timeout "${BACKWARD_PYTEST_TIMEOUT:-150}" \
          "$py" -m pytest -q -m gpu ${WSBACKWARD_PYTEST_PATHS:-tests/python/test_attention_cuda.py} -p no:cacheprovider \
          > "$work/wsbackward/pytest.log" 2>&1 || status=1
        tail -4 "$work/wsbackward/pytest.log"
      fi
      clocks_start "$work/wsbackward/clocks.csv"
      MEMBAR_RESULTS_DIR=$work/wsbackward timeout 300 "$py" bench/attention_bench.py \
        --histories "${ATTENTION_HISTORIES:-32768,131072,262144}" --head-dims "" \
        --try-history-backward-layouts "${WSBACKWARD_TRY:-wgmma_w8_k128}" \
        > "$work/wsbackward/bench.log" 2>&1 || status=1
      clocks_stop
      cat "$work/wsbackward/attention.txt" 2>/dev/null || tail -20 "$work/wsbackward/bench.log"
      "$py" tools/clocks_summary.py "$work/wsbackward/clocks.csv" ;;
    bwdsplit)
      mkdir -p "$work/bwdsplit"
      timeout 240 "$py" bench/probes/backward_kernels_probe.py "$work/bwdsplit/backward_kernels.json" \
        ${BWDSPLIT_HISTORIES:-131072 262144} > "$work/bwdsplit/probe.log" 2>&1 || status=1
      tail -12 "$work/bwdsplit/probe.log" ;;
    ncu)
      # Nsight Compute's counters of the chosen forward and backward (bench/probes/attention_ncu_probe.py)
      # at NCU_HISTORIES: speed of light, memory (L2 hit rate, DRAM bytes), warp stalls, schedulers.
      mkdir -p "$work/ncu"
      ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      for history in ${NCU_HISTORIES:-32768 262144}; do
        timeout "${NCU_TIMEOUT:-150}" "$ncu_bin" --clock-control none --kernel-name-base function \
          --kernel-name "regex:paged_attention_(forward_ws|backward_wgmma|backward_wgmma_ws)_kernel" --launch-skip 2 --launch-count 2 \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
          --section ComputeWorkloadAnalysis --section Occupancy \
          "$py" bench/probes/attention_ncu_probe.py "$history" > "$work/ncu/ncu_$history.txt" 2>&1 || status=1
        grep -E "paged_attention|Duration|Memory Throughput|L2 Hit|DRAM Throughput|L1/TEX Hit|Compute \(SM\)|Issue Slots Busy|No Eligible|Stall|Warp Cycles Per Issued" \
          "$work/ncu/ncu_$history.txt" | head -40
        # Why warps wait (cycles per issued instruction, by reason), the backward only.
        timeout "${NCU_TIMEOUT:-150}" "$ncu_bin" --clock-control none --kernel-name-base function \
          --kernel-name "regex:paged_attention_backward_wgmma(_ws)?_kernel" --launch-skip 1 --launch-count 1 \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
          "$py" bench/probes/attention_ncu_probe.py "$history" > "$work/ncu/stalls_$history.txt" 2>&1 || status=1
        grep -E "stalled" "$work/ncu/stalls_$history.txt" | sort -k3 -g -r | head -8
      done ;;
    softcap)
      # Gemma 2 (4 layers of the 9B shape, 32K, chunk-recurrent): soft-capped global layers on the
      # paged kernels against the PyTorch path (MEMBAR_CUDA_SOFTCAP=0), in one call.
      gemma_kernels_or_pytorch softcap MEMBAR_CUDA_SOFTCAP "soft-capped layers on the kernels" ;;
    wintests)
      # The sliding-window kernels (Note [Sliding window in the kernels]): every gpu C++ test, then the
      # Python attention tests and the trainer's bf16 gradient errors with windowed layers on the kernels.
      mkdir -p "$work/wintests"
      ctest --test-dir build-gpu -L gpu --output-on-failure --timeout 300 > "$work/wintests/gpu_ctest.log" 2>&1 || status=1
      tail -4 "$work/wintests/gpu_ctest.log"
      timeout ${PYTEST_TIMEOUT:-240} "$py" -m pytest -q -m gpu tests/python/test_attention_cuda.py \
        tests/python/test_oomb_models.py -p no:cacheprovider --durations=8 \
        > "$work/wintests/gpu_pytest.log" 2>&1 || status=1
      tail -14 "$work/wintests/gpu_pytest.log" ;;
    window)
      # Gemma 2 (4 layers of the 9B shape, 32K, chunk-recurrent): its sliding-window layers on the paged
      # kernels (Note [Sliding window]) against the PyTorch path (MEMBAR_CUDA_WINDOW=0), soft-capped
      # layers on the kernels in both, in one call.
      gemma_kernels_or_pytorch window MEMBAR_CUDA_WINDOW "sliding-window layers on the kernels" ;;
    models)
      mkdir -p "$work/models"
      coverage_models=""
      if [ "${COVERAGE_QUICK:-0}" = 1 ]; then coverage="--quick"; else coverage_models=${COVERAGE_MODELS:-qwen3-8b}; coverage_models=${coverage_models//,/ }; fi
      # COVERAGE_MERGE: a results file to add rows to; it must travel with the call (the device tree
      # leaves bench/results out, tools/device_tree.sh): merge earlier calls' rows here instead.
      if [ -n "${COVERAGE_MERGE:-}" ]; then cp "$COVERAGE_MERGE" "$work/models/model_coverage.json" || status=1; fi
      # One process per model (each merges its rows into the same file): a model's OOM or failure
      # cannot leave memory behind for the next one (session 24: Qwen3-8B after Gemma-2-9B's OOM).
      models_started=$(date +%s)
      for coverage_model in ${coverage_models:-}; do
        left=$(( ${COVERAGE_BUDGET:-500} - ($(date +%s) - models_started) ))
        [ "$left" -gt 0 ] || { log "models: no time left for $coverage_model"; continue; }
        # shellcheck disable=SC2086  # COVERAGE_ARGS is a list of options
        MEMBAR_RESULTS_DIR=$work/models timeout $(( left + 60 )) "$py" bench/model_coverage_bench.py \
          --models "$coverage_model" ${COVERAGE_ARGS:-} --time-budget "$left" >> "$work/models/bench.log" 2>&1 || status=1
      done
      if [ -z "${coverage_models:-}" ]; then
        # shellcheck disable=SC2086  # COVERAGE_ARGS is a list of options
        MEMBAR_RESULTS_DIR=$work/models timeout 560 "$py" bench/model_coverage_bench.py $coverage ${COVERAGE_ARGS:-} \
          --time-budget "${COVERAGE_BUDGET:-500}" > "$work/models/bench.log" 2>&1 || status=1
      fi
      tail -15 "$work/models/model_coverage.md" 2>/dev/null || tail -20 "$work/models/bench.log" ;;
    dp)
      bench dp --contexts 32K --time-budget 300 --variants "dense,dense+dp" ;;
    cli)
      mkdir -p "$work/cli"
      socket=/tmp/membar-cli.sock
      train="-m membar.train --model qwen2.5-7b --seq-len ${CLI_SEQ:-32K} --chunk 4096 --steps 3 --no-progress --json"
      for mode in ${CLI_MODES:-dense offload}; do
        case $mode in
          dense) extra="" ;;
          sparse) extra="--mode sparse" ;;
          sparse-offload) extra="--mode sparse --offload" ;;
          dense-splitbwd) extra="" ;;
          *) extra="--offload" ;;
        esac
        if [ $mode = offload-streamwait ]; then   # embedded only: its stream waits on the GPU (Note [Enqueued tickets])
          MEMBAR_STREAM_WAIT=1 timeout 240 "$py" $train $extra > "$work/cli/embedded-$mode.log" 2>&1 || status=1
          continue
        fi
        if [ $mode = dense-splitbwd ]; then   # embedded only: the split mma.sync backward instead of the chosen one
          MEMBAR_CUDA_BACKWARD_LAYOUT=w8_k128_split_s2_pad timeout 240 "$py" $train $extra \
            > "$work/cli/embedded-$mode.log" 2>&1 || status=1
          continue
        fi
        if [ $mode = offload-private ]; then   # a membard of the run's own (--socket private)
          timeout 240 "$py" $train $extra --socket private > "$work/cli/private-offload.log" 2>&1 || status=1
          continue
        fi
        timeout 240 "$py" $train $extra > "$work/cli/embedded-$mode.log" 2>&1 || status=1
        start_daemon "$socket" --gpu-pool "${CLI_GPU_POOL:-16GiB}" --host-pool "${CLI_HOST_POOL:-32GiB}" \
          || { status=1; continue; }
        timeout 240 "$py" $train $extra --socket "$socket" > "$work/cli/membard-$mode.log" 2>&1 || status=1
        "$bin/membarctl" --socket "$socket" stats --json > "$work/cli/membarctl-$mode.json" 2>&1
        kill "$daemon"; wait "$daemon" 2>/dev/null
      done
      "$py" tools/cli_summary.py "$work/cli" | tee "$work/cli/summary.txt" ;;
    sparse1m)
      # One whole sparse step at SPARSE_CONTEXT (default 1M) through membard: top-64 pages, one
      # selection per chunk, as many layers' pages in membard's GPU pool as fit beside the streamed
      # blocks (90 GiB: 14 of 28 layers at 1M), the rest in its host pool (96 GiB). Takes a whole
      # call: run it alone on a warm machine (built by the call before), with BENCH_TIMEOUT=585 under
      # `timeout 595` (session 11: the step's chunks took 493 s after ~75 s of start-up, and the
      # default 570 s cut the bench off before it reported; session 12: the bench's own limit per
      # configuration, then 470 s, ended it at 486 s, after the last chunk: 560 s now).
      socket=/tmp/membar-sparse.sock
      start_daemon "$socket" --gpu-pool "${SPARSE_GPU_POOL:-90GiB}" --host-pool "${SPARSE_HOST_POOL:-96GiB}" \
        || { status=1; continue; }
      MEMBAR_PROGRESS_SECONDS=30 MEMBAR_SOCKET=$socket bench sparse1m --contexts "${SPARSE_CONTEXT:-1M}" --variants sparse-hybrid \
        --query-tile 4096 --time-limit "${SPARSE_LIMIT:-560}"
      "$bin/membarctl" --socket "$socket" stats --json > "$work/sparse1m/membarctl_stats.json" 2>&1
      kill "$daemon"; wait "$daemon" 2>/dev/null ;;
    wgsweep)
      mkdir -p "$work/wgsweep"
      cmake --build build-gpu -j 16 --target membar_attention_sweep > "$work/wgsweep/build.log" 2>&1 \
        || { status=1; tail -20 "$work/wgsweep/build.log"; }
      MEMBAR_BUILD_DIR=$root/build-gpu MEMBAR_RESULTS_DIR=$work/wgsweep timeout 420 "$py" bench/attention_sweep.py \
        --histories 32768,131072 \
        --forward "${SWEEP_FORWARD:-wgmma_w8r64_k128_s2,wgmma_w8r64_k64_s3,wgmma_w8r64_k64_s3_overlap}" \
        --backward "${SWEEP_BACKWARD:-wgmma_w8_k128,w8_k128_split_s2_pad}" > "$work/wgsweep/bench.log" 2>&1 || status=1
      tail -30 "$work/wgsweep/attention_sweep.txt" 2>/dev/null || tail -30 "$work/wgsweep/bench.log" ;;
    enqueue)
      mkdir -p "$work/enqueue"
      timeout 200 "$py" bench/probes/enqueue_probe.py "$work/enqueue/enqueue_probe.json" > "$work/enqueue/enqueue_probe.txt" 2>&1 || status=1
      cat "$work/enqueue/enqueue_probe.txt" ;;
    select)
      mkdir -p "$work/select"
      timeout 200 "$py" bench/probes/select_probe.py "$work/select/select_probe.json" > "$work/select/select_probe.txt" 2>&1 || status=1
      cat "$work/select/select_probe.txt" ;;
    growth)
      bench growth --contexts 128K,256K --time-budget 540 --variants dense-offload ;;
    sparseblocks)
      bench sparseblocks --contexts "${SPARSE_BLOCKS_CONTEXTS:-256K}" --time-budget 540 --query-tile 4096 \
        --variants "sparse-offload,sparse-offload+blockwise" ;;
    dense1m)
      # The 1M dense partial step (stage 1 and the two longest stage-2 chunks; Note [Partial steps])
      # through membard, against session 4's 415.5 s + 24.2 s with tensor pools (issue: within 5%).
      socket=/tmp/membar-dense.sock
      start_daemon "$socket" --gpu-pool "${DENSE_GPU_POOL:-90GiB}" --host-pool "${DENSE_HOST_POOL:-96GiB}" \
        || { status=1; continue; }
      MEMBAR_PROGRESS_SECONDS=30 MEMBAR_SOCKET=$socket bench dense1m --contexts 1M --variants dense-hybrid --stage2-chunks 2 --time-limit 560
      "$bin/membarctl" --socket "$socket" stats --json > "$work/dense1m/membarctl_stats.json" 2>&1
      kill "$daemon"; wait "$daemon" 2>/dev/null ;;
    share)
      mkdir -p "$work/share"
      socket=/tmp/membar-share.sock
      train="-m membar.train --model qwen2.5-1.5b --seq-len 32K --chunk 4096 --steps 3 --offload --no-progress --json"
      timeout 200 "$py" $train > "$work/share/alone.log" 2>&1 || status=1
      start_daemon "$socket" --gpu-pool 24GiB --host-pool 48GiB || { status=1; continue; }
      trainers=""
      for i in 1 2; do
        timeout 300 "$py" $train --socket "$socket" > "$work/share/shared-$i.log" 2>&1 &
        trainers="$trainers $!"
      done
      # Snapshot while both are attached (their quotas and spaces), not after they finished.
      for _ in $(seq 240); do
        attached=$("$bin/membarctl" --socket "$socket" stats --json 2>/dev/null \
          | "$py" -c 'import json,sys; print(len(json.load(sys.stdin).get("clients", [])))' 2>/dev/null)
        [ "${attached:-0}" -ge 2 ] && break
        sleep 0.25
      done
      sleep 5; "$bin/membarctl" --socket "$socket" stats > "$work/share/membarctl_during.txt" 2>&1
      for pid in $trainers; do wait "$pid" || status=1; done
      "$bin/membarctl" --socket "$socket" stats --json > "$work/share/membarctl_after.json" 2>&1
      kill "$daemon"; wait "$daemon" 2>/dev/null
      "$py" tools/cli_summary.py "$work/share" | tee "$work/share/summary.txt" ;;
    tp)
      mkdir -p "$work/tp"
      gpus=$(nvidia-smi -L | wc -l)
      seq=${TP_SEQ:-128K}
      train="-m membar.train --model qwen2.5-7b --chunk 4096 --steps 2 --no-progress --json"
      run="$py -m torch.distributed.run --standalone --nproc_per_node $gpus"
      timeout 200 "$py" $train --seq-len "$seq" > "$work/tp/one_gpu.log" 2>&1 || status=1
      timeout 200 $run $train --seq-len "$seq" --tensor-parallel "$gpus" > "$work/tp/heads_split_${gpus}.log" 2>&1 || status=1
      timeout 200 $run $train --seq-len "$seq" > "$work/tp/data_parallel_${gpus}.log" 2>&1 || status=1
      # LoGRA over split heads (Note [LoGRA over split heads]) beside one GPU's LoGRA step.
      timeout 200 "$py" $train --seq-len "$seq" --optimizer logra > "$work/tp/one_gpu_logra.log" 2>&1 || status=1
      timeout 200 $run $train --seq-len "$seq" --tensor-parallel "$gpus" --optimizer logra \
        > "$work/tp/heads_split_${gpus}_logra.log" 2>&1 || status=1
      if [ "${TP_LONG:-0}" = 1 ]; then   # the context that only the split fits: gpus x seq
        long=$("$py" -c "from membar.train import _tokens; print(_tokens('$seq') * $gpus)")
        timeout 560 $run $train --seq-len "$long" --tensor-parallel "$gpus" --steps 1 --offload \
          > "$work/tp/heads_split_${gpus}_long.log" 2>&1 || status=1
      fi
      "$py" tools/cli_summary.py "$work/tp" | tee "$work/tp/summary.txt" ;;
    offload)
      bench offload --contexts 256K --time-budget 540 --variants "dense-offload,dense-offload+logra" ;;
    daemon)
      socket=/tmp/membar-session.sock
      start_daemon "$socket" --gpu-pool 24GiB --host-pool 40GiB || { status=1; continue; }
      MEMBAR_SOCKET=$socket bench daemon --contexts "${DAEMON_CONTEXTS:-32K,128K}" --time-budget "${DAEMON_BUDGET:-300}" \
        --variants "${DAEMON_VARIANTS:-dense:32K,dense-offload:128K}"
      "$bin/membarctl" --socket "$socket" stats --json > "$work/daemon/membarctl_stats.json" 2>&1
      kill "$daemon"; wait "$daemon" 2>/dev/null
      [ "${DAEMON_EMBEDDED:-1}" = 1 ] && bench daemon-embedded --contexts "${DAEMON_CONTEXTS:-32K,128K}" \
        --time-budget 240 --variants "${DAEMON_VARIANTS:-dense:32K,dense-offload:128K}" ;;
    hostpool)
      mkdir -p "$work/hostpool"
      (
        ulimit -n 1024
        socket=/tmp/membar-hostpool.sock
        started=$(date +%s.%N)
        start_daemon "$socket" --gpu-pool 100GiB --host-pool 100GiB || exit 1
        serving=$(date +%s.%N)
        for _ in $(seq 1200); do
          preparing=$("$bin/membarctl" --socket "$socket" stats --json 2>/dev/null \
            | "$py" -c 'import json,sys; print(sum(t["frames_preparing"] for t in json.load(sys.stdin)["tiers"]))' 2>/dev/null)
          [ "$preparing" = 0 ] && break
          sleep 0.25
        done
        pinned=$(date +%s.%N)
        fds=$(ls /proc/$daemon/fd | wc -l)
        "$bin/membarctl" --socket "$socket" stats > "$work/hostpool/membarctl_stats.txt" 2>&1
        kill "$daemon"; wait "$daemon" 2>/dev/null
        "$py" - "$started" "$serving" "$pinned" "$fds" <<'EOF' | tee "$work/hostpool/hostpool.json"
import json, sys
started, serving, pinned, fds = map(float, sys.argv[1:])
print(json.dumps({"gpu_pool_gib": 100, "host_pool_gib": 100, "ulimit_n": 1024, "seconds_to_serve": serving - started,
                  "seconds_to_host_pool_pinned": pinned - started, "open_descriptors": int(fds)}))
EOF
      ) || status=1 ;;
    *) log "unknown step $step"; status=1 ;;
  esac
done
pack
log "done (status $status)"
exit $status
