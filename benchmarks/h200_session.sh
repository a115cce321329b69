#!/usr/bin/env bash
# One device-tool call on the H200 (see DEVELOPERS.md / the README's GPU section): install the
# CuTe DSL bundle if this call carries part 2, install fusec, then run the named stages from a
# scratch folder (the checkout's tests/ and benchmarks/ copied there, so its folders do not
# shadow the installed package). Logs go to $OUT (the device tool brings them back).
#
#   bash benchmarks/h200_session.sh speed model-k3 model-small tests compile
#   SPEED_CONFIG=slice4-e128 bash benchmarks/h200_session.sh ratio      # benchmarks/speed.py, fusec vs the baseline
#   RANKS_BATCHES=1 bash benchmarks/h200_session.sh ranks               # 2 GPUs: benchmarks/ranks.py (torchrun)
#   MODEL_CASES=kimi_k3:tiny MODEL_BATCHES=1,16 bash benchmarks/h200_session.sh bodies model
#   PLAN_VARIANTS="expert_stream=ring" PLAN_BATCHES=16,4,1 bash benchmarks/h200_session.sh variants
#   GPU_TESTS=tests/gpu/test_step_graph.py BODIES_K=tiles bash benchmarks/h200_session.sh tests bodies
#   OVERHEAD_CONFIG=slice4-e128 OVERHEAD_BATCHES=1 bash benchmarks/h200_session.sh overhead   # step_overhead.py
set -u
[ -f .gpu-bundle/part2/install.sh ] && { bash .gpu-bundle/part2/install.sh || exit 3; }
export PYTHONPATH=/tmp/fusec-pkg:/tmp/fusec-site:/tmp/fusec-site/nvidia_cutlass_dsl/dsl_packages
python3 -c "import cutlass" 2>/dev/null || { echo "CuTe DSL not staged: run .gpu-bundle/part1/stage.sh first"; exit 3; }
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/fusec-pkg --upgrade . >/dev/null 2>&1
OUT=${OUT:-/tmp/fusec-out}
mkdir -p "$OUT"
rm -rf /tmp/w && mkdir -p /tmp/w && cp -r tests benchmarks /tmp/w/ && cd /tmp/w
for stage in "$@"; do
  case $stage in
    speed) FUSEC_PROFILE_DIR=$OUT timeout 420 python3 benchmarks/cute_speed.py --config ${SPEED_CONFIG:-slice4} \
             --batches ${SPEED_BATCHES:-1,4,16} --reps 20 --prefetch-kb ${SPEED_PF:-0,64} \
             --gemv-variants=${SPEED_GEMV:-} --plan-variants="${SPEED_PLAN:-}" --profile-plan="${SPEED_PROFILE_PLAN:-}" 2>&1 | grep -v Warn | tee "$OUT/speed.log" | tail -30 ;;
    model-k3) timeout 540 python3 benchmarks/cute_model.py --cases kimi_k3:slice4,kimi_k3:slice4-e128 \
                --batches 1,4,16 --delay-cases none 2>&1 | grep -v Warning > "$OUT/model_k3.log"; tail -14 "$OUT/model_k3.log" ;;
    model-small) timeout 400 python3 benchmarks/cute_model.py --cases kimi_k3:tiny,llama:tiny,llama:llama-3.2-1b \
                   --batches 1,4,16 --delay-cases llama:tiny,kimi_k3:tiny 2>&1 | grep -v Warning > "$OUT/model_small.log"
                 tail -16 "$OUT/model_small.log" ;;
    tests) # one pytest per file, each with what is left of TESTS_BUDGET seconds, so a timeout costs one
           # file's summary only (the whole tests/gpu takes more than one 600 s device call: split
           # GPU_TESTS over two calls); a file cut by the timeout is named in the log
           end=$(( $(date +%s) + ${TESTS_BUDGET:-540} ))
           for f in ${GPU_TESTS:-$(ls -d tests/gpu/test_*.py)}; do
             left=$(( end - $(date +%s) ))
             if [ $left -le 10 ]; then echo "$f: not run (TESTS_BUDGET spent)"; continue; fi
             timeout $left python3 -m pytest -q -rP -m gpu $f -p no:warnings > /tmp/pytest_one.log 2>&1
             rc=$?
             { echo "== $f"; cat /tmp/pytest_one.log; } >> "$OUT/pytest_gpu.log"
             if [ $rc -eq 124 ]; then echo "$f: cut by the timeout" | tee -a "$OUT/pytest_gpu.log"
             else echo "$f: $(grep -E "passed|failed|error|skipped|no tests ran" /tmp/pytest_one.log | tail -1)"; fi
           done ;;
    gemv) timeout 400 python3 benchmarks/gemv_megakernel.py 2>&1 | grep -v Warn > "$OUT/gemv.log"; tail -40 "$OUT/gemv.log" ;;
    compile) for b in 4 16; do echo "B=$b"; timeout 300 python3 benchmarks/reference_compile.py --batch $b 2>&1 \
               | grep -v -i warn; done | tee "$OUT/reference_compile.log" ;;
    ratio) timeout 580 python3 benchmarks/speed.py --config ${SPEED_CONFIG:-slice4-e128} --batches ${SPEED_BATCHES:-1,4,16} \
             --rounds ${SPEED_ROUNDS:-5} --json "$OUT/speed.json" 2>&1 | grep -v Warn | tee "$OUT/ratio.log" | tail -24 ;;
    gemv-tests) timeout 300 python3 -m pytest -q -rP -m gpu tests/gpu/test_cute_gemv.py -p no:warnings > "$OUT/pytest_gemv.log" 2>&1
                grep -E "passed|failed|error|Error" "$OUT/pytest_gemv.log" | tail -20 ;;
    mla) timeout 300 python3 benchmarks/mla_partial.py --batches ${MLA_BATCHES:-1,4,16} --variants "${MLA_VARIANTS:-}" ${MLA_ARGS:-} 2>&1 \
           | grep -v Warn > "$OUT/mla_partial.log"; tail -16 "$OUT/mla_partial.log" ;;
    bodies) timeout 300 python3 -m pytest -q -rP -m gpu tests/gpu/test_cute_bodies.py -k "${BODIES_K:-}" -p no:warnings > "$OUT/pytest_bodies.log" 2>&1
            grep -E "passed|failed|error|Error" "$OUT/pytest_bodies.log" | tail -20 ;;
    model) timeout 540 python3 benchmarks/cute_model.py --cases ${MODEL_CASES:-kimi_k3:tiny} --batches ${MODEL_BATCHES:-1,4,16} \
             --delay-cases ${MODEL_DELAY:-none} 2>&1 | grep -v Warning > "$OUT/model.log"; tail -14 "$OUT/model.log" ;;
    ranks) # two GPUs (device kind nvidia-h200-x2): fusec R=2 (split_reduce gated / off) vs R=1 vs a TP=2 baseline;
           # one batch per device call fits the 10-minute limit better (RANKS_BATCHES=1, then 4, then 16;
           # merge the returned files with `python benchmarks/ranks.py --merge ...`)
           NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 timeout 590 \
             python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/ranks.py \
             --config ${RANKS_CONFIG:-slice4-e128} --batches ${RANKS_BATCHES:-1,4,16} --rounds ${RANKS_ROUNDS:-5} \
             --json "$OUT/ranks.json" ${RANKS_ARGS:-} 2>&1 | grep -v Warn | tee "$OUT/ranks.log" | tail -30 ;;
    wgmma) # the MLA partial prototype on wgmma (mla_wgmma_proto.py): its check against torch, then its time
           timeout 300 python3 benchmarks/mla_wgmma_proto.py --rows ${WGMMA_ROWS:-512} --ctas ${WGMMA_CTAS:-132} 2>&1 \
             | grep -v Warn | tee "$OUT/mla_wgmma_proto.log" | tail -6 ;;
    overhead) timeout 400 python3 benchmarks/step_overhead.py --config ${OVERHEAD_CONFIG:-tiny} --batches ${OVERHEAD_BATCHES:-1,16} \
                2>&1 | grep -v Warn | tee "$OUT/step_overhead.log" | tail -40 ;;
    mxbody) # MXBODY_VARIANTS="expert_mx_down_unroll=4 expert_mx_glu_unroll=2" (space-separated builds)
            timeout 500 python3 benchmarks/mx_expert_body.py --batches ${MXBODY_BATCHES:-16,1} \
              --variants "${MXBODY_VARIANTS:-}" ${MXBODY_ARGS:-} 2>&1 | grep -v Warn \
              | tee "$OUT/mx_expert_body.log" | tail -30 ;;
    ncu) # Nsight Compute on mx_expert_body.py's kernels (Firecracker machines only; clocks left alone):
         # NCU_KERNELS="mx_glu_b16_0 mx_glu_b16_1" NCU_ARGS="--variants expert_mx_probe=no_decode" bash ... ncu
         for kn in ${NCU_KERNELS:-mx_glu_b16_0}; do
           timeout 280 ncu --clock-control none --kernel-name regex:"$kn" --launch-count 1 \
             --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SpeedOfLight \
             python3 benchmarks/mx_expert_body.py --batches ${NCU_BATCH:-16} --probes "" --no-bf16 --rounds 1 --reps 1 \
             ${NCU_ARGS:-} > "$OUT/ncu_$kn.log" 2>&1
           grep -v -i warn "$OUT/ncu_$kn.log" | grep -E "^  [A-Z]|Stall|Issue|Throughput|Warp Cycles|Eligible|Active|Hit|DRAM|L1|L2|==ERR|rror" | head -60
         done ;;
    ncu-mx-src) # Nsight Compute with source counters on one mx_expert_body.py kernel: stalls per SASS line
                # (ncu_mx_sass.csv; its summary by benchmarks/ncu_sass_summary.py in ncu_mx_stalls.txt).
                # NCU_KERNELS=mx_glu_b16_0 NCU_BATCH=16 [NCU_ARGS="--variants f=v"] bash ... ncu-mx-src
                kn=${NCU_KERNELS:-mx_glu_b16_0}
                timeout 400 ncu --clock-control none --kernel-name regex:"$kn" --launch-count 1 \
                  --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SpeedOfLight \
                  --section SourceCounters --section LaunchStats --section ComputeWorkloadAnalysis \
                  --import-source no -f -o "$OUT/ncu_mx" \
                  python3 benchmarks/mx_expert_body.py --batches ${NCU_BATCH:-16} --probes "" --no-bf16 --rounds 1 --reps 1 \
                  ${NCU_ARGS:-} > "$OUT/ncu_mx_run.log" 2>&1
                ncu --import "$OUT/ncu_mx.ncu-rep" > "$OUT/ncu_mx.log" 2>&1
                ncu --import "$OUT/ncu_mx.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_mx_sass.csv" 2>&1
                python3 benchmarks/ncu_sass_summary.py "$OUT/ncu_mx_sass.csv" > "$OUT/ncu_mx_stalls.txt" 2>&1
                grep -v -i warn "$OUT/ncu_mx.log" | grep -E "^  [A-Z]|Stall|Issue|Throughput|Warp Cycles|Eligible|Active|Hit|DRAM|Registers|Pipe|==ERR|rror" | head -70 ;;
    ncu-mla) # Nsight Compute on the MLA PARTIAL body alone (mla_partial.py, one step): stalls by reason and
             # the SASS lines they sample. NCU_BATCH=16 [MLA_VARIANTS=...] bash benchmarks/h200_session.sh ncu-mla
             timeout 400 ncu --clock-control none --kernel-name regex:kernel_cutlass_mla --launch-skip 1 --launch-count 1 \
               --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SpeedOfLight \
               --section SourceCounters --section LaunchStats --section Occupancy \
               --import-source no -f -o "$OUT/ncu_mla" \
               python3 benchmarks/mla_partial.py --batches ${NCU_BATCH:-16} --reps 1 --variants "${MLA_VARIANTS:-}" \
               > "$OUT/ncu_mla_run.log" 2>&1
             ncu --import "$OUT/ncu_mla.ncu-rep" > "$OUT/ncu_mla.log" 2>&1
             # per SASS instruction: executed count and stall samples (read offline)
             ncu --import "$OUT/ncu_mla.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_mla_sass.csv" 2>&1
             grep -v -i warn "$OUT/ncu_mla.log" | grep -E "^  [A-Z]|Stall|Issue|Throughput|Warp Cycles|Eligible|Active|Hit|DRAM|Registers|==ERR|rror" | head -70 ;;
    ncu-step) # Nsight Compute on one whole megakernel step (benchmarks/ncu_step.py): what its warps stall on;
              # NCU_CONFIG=slice4-e128 NCU_BATCH=1 [NCU_PLAN="weight_evict_first="] bash benchmarks/h200_session.sh ncu-step
              timeout 400 ncu --clock-control none --kernel-name regex:megakernel --launch-skip 2 --launch-count 1 \
                --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SpeedOfLight \
                python3 benchmarks/ncu_step.py --config ${NCU_CONFIG:-slice4-e128} --batch ${NCU_BATCH:-1} \
                --plan "${NCU_PLAN:-}" > "$OUT/ncu_step.log" 2>&1
              grep -v -i warn "$OUT/ncu_step.log" | grep -E "^  [A-Z]|Stall|Issue|Throughput|Warp Cycles|Eligible|Active|Hit|DRAM|L1|L2|==ERR|rror|steps run" | head -60 ;;
    variants) # KernelPlan variants against the default build, one batch per run (plan_variants.py):
              # PLAN_VARIANTS="expert_stream=ring" PLAN_BATCHES=16,4,1 [PLAN_ARGS=--control] bash benchmarks/h200_session.sh variants
              pb=${PLAN_BATCHES:-16,4,1}
              for b in ${pb//,/ }; do
                timeout 280 python3 benchmarks/plan_variants.py --config ${SPEED_CONFIG:-slice4-e128} --batch $b \
                  --variants "${PLAN_VARIANTS:-expert_stream=ring}" --rounds ${PLAN_ROUNDS:-3} ${PLAN_ARGS:-} 2>&1 | grep -v Warn
              done | tee "$OUT/plan_variants.log" | grep -E "^\||built" ;;
    absplit) # one op's seq_split on and off side by side (ab_seq_split.py), one batch per run:
             # AB_OP=argmax PLAN_BATCHES=1,16 [PLAN_ARGS=--control] SPEED_CONFIG=slice4-e128 bash benchmarks/h200_session.sh absplit
             pb=${PLAN_BATCHES:-1,16}
             for b in ${pb//,/ }; do
               timeout 280 python3 benchmarks/ab_seq_split.py --config ${SPEED_CONFIG:-slice4-e128} --batch $b \
                 --op ${AB_OP:-argmax} --rounds ${PLAN_ROUNDS:-5} ${PLAN_ARGS:-} 2>&1 | grep -v Warn
             done | tee "$OUT/ab_seq_split.log" | grep -E "^\||built|error" ;;
    *) echo "unknown stage $stage (gemv, gemv-tests, mla, speed, ratio, ranks, bodies, model, model-k3, model-small, tests, compile, variants, absplit, overhead, mxbody, ncu, ncu-mx-src, ncu-mla, ncu-step, wgmma)"; exit 2 ;;
  esac
done
