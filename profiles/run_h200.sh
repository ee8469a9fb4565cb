#!/usr/bin/env bash
# One device call's worth of GPU tests, benchmarks and profiles for the fusion work (issue 6), writing
# everything under $OUT (default ./h200_out). Run from the repository root on a CUDA machine with graphrt
# installed. Stages (default: all but tests-all, in this order): tests, bench-1b, bench-smollm2, bench-8b,
# bench-sampling (the samplers alone, then engine steps with temperature, top-p and top-k + top-p),
# dependent, gemv, profile, host, nvtx. Others: tests-all (every gpu-marked test), tests-engine (those of
# the decode runner and engine), tests-sampling (the samplers'), profile-8b (the 8B's batch-1 step with
# plain and dependent launches), gemv-tma (the TMA experiment), few-rows (the 2-16-row kernel's sweep),
# few-rows-norm-after (its layers with the norm after the products), decode-splits (the attention's split
# counts at head size 64), step-tiles and step-attention (tiles and split counts timed inside the step), attention-floor (the attention against a bare kernel in its place), decode-big-tile (longer K/V tiles at batch 1 and 8), merge-tile (the merge's tile size), grid-barrier (a phase dependency's cost as a
# kernel boundary and as a grid barrier). profiles/notes_fusion.md says what each measured.
set -uo pipefail
OUT=${OUT:-h200_out}
mkdir -p "$OUT"
stages=${*:-tests bench-1b bench-smollm2 bench-8b bench-sampling dependent gemv profile host nvtx}
log() { echo "== $(date +%T) $*"; }

for stage in $stages; do
  case $stage in
    tests)
      log "gpu tests: fused kernels, engines vs HF and vs unfused, graphs"
      python -m pytest -q -m gpu -p no:cacheprovider tests/test_fused_kernels.py tests/test_gemv.py tests/test_dependent_launch.py tests/test_qkv_rope_cache.py tests/test_triton_paged_decode.py \
        tests/test_gpu_engine.py tests/test_gpu_graphs.py -s 2>&1 | grep -v "set_sync_debug_mode\|^  *torch._C\|^$" | tee "$OUT/gpu_tests.log" | tail -60
      ;;
    tests-engine)
      log "gpu tests of the decode runner and engine (graphs, pipelined steps, HF agreement, dependent launches)"
      python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_graphs.py tests/test_gpu_engine.py \
        tests/test_dependent_launch.py -s 2>&1 | grep -v "set_sync_debug_mode\|^  *torch._C\|^$" \
        | tee "$OUT/gpu_tests_engine.log" | tail -30
      ;;
    tests-all)
      log "every gpu-marked test"
      python -m pytest -q -m gpu -p no:cacheprovider tests -s 2>&1 | tee "$OUT/gpu_tests_all.log" | tail -40
      ;;
    bench-1b)
      log "bench llama-3.2-1b, ctx 512 and 4096 (fused, unfused beside)"
      graphrt bench --model random:llama-3.2-1b --batch-sizes 1,8,64,256 --contexts 512,4096 --compare-unfused \
        --json "$OUT/bench_llama1b.json" --plot "$OUT/bench_llama1b.png"
      ;;
    bench-smollm2)
      log "bench smollm2-135m, ctx 512"
      graphrt bench --model random:smollm2-135m --batch-sizes 1,8,64,256 --compare-unfused \
        --json "$OUT/bench_smollm2.json"
      ;;
    bench-8b)
      log "bench llama-3-8b, ctx 512"
      graphrt bench --model random:llama-3-8b --batch-sizes 1,8,64,256 --compare-unfused \
        --json "$OUT/bench_llama8b.json"
      ;;
    bench-sampling)
      log "sampling alone: argmax, temperature race, top-k/top-p search and sort, side by side"
      python profiles/bench_sampling.py --json "$OUT/sampling.json"
      log "bench llama-3.2-1b ctx 512: temperature 0.8, then top-p 0.9 and top-k 50 + top-p 0.9 (threshold search)"
      graphrt bench --model random:llama-3.2-1b --batch-sizes 1,8,64,256 --temperature 0.8 \
        --json "$OUT/bench_llama1b_temperature.json"
      graphrt bench --model random:llama-3.2-1b --batch-sizes 1,8,64,256 --temperature 0.8 --top-p 0.9 \
        --json "$OUT/bench_llama1b_top_p.json"
      graphrt bench --model random:llama-3.2-1b --batch-sizes 1,8,64,256 --temperature 0.8 --top-k 50 --top-p 0.9 \
        --json "$OUT/bench_llama1b_top_k_top_p.json"
      ;;
    tests-sampling)
      log "gpu tests of the samplers (threshold search against the sorting sampler, capture)"
      python -m pytest -q -m gpu -p no:cacheprovider tests/test_top_k_top_p.py tests/test_fused_kernels.py -k "sampl or argmax" \
        2>&1 | tee "$OUT/gpu_tests_sampling.log" | tail -15
      ;;
    dependent)
      log "decode steps with plain and dependent kernel launches, side by side"
      python profiles/bench_dependent_launch.py --json "$OUT/dependent_launch.json"
      ;;
    gemv)
      log "batch-1 GEMV kernels against cuBLAS: per layer, LM head, tile sweep"
      python profiles/bench_gemv.py --json "$OUT/gemv.json"
      ;;
    decode-splits)
      log "paged decode split counts at head size 64 (1B, SmolLM2 shapes)"
      python profiles/bench_decode_splits.py --json "$OUT/decode_splits.json"
      ;;
    decode-big-tile)
      log "paged decode at batch 1 and 8, context 512: K/V tiles of 128-512 tokens, 4 and 8 warps, every split count"
      python profiles/bench_decode_splits.py --points 1x512 8x512 --block-n 128 256 512 --num-warps 4 8 \
        --json "$OUT/decode_big_tile.json"
      ;;
    merge-tile)
      log "paged decode: the merge's tile (registers) at 1-8 rows, context 4096"
      python profiles/bench_decode_splits.py --merge-tiles 8192 2048 --points 1x4096 2x4096 3x4096 4x4096 8x4096 \
        --json "$OUT/merge_tile.json"
      ;;
    grid-barrier)
      log "a phase dependency as a dependent kernel launch against a grid barrier in a persistent kernel"
      timeout 120 python profiles/bench_grid_barrier.py --json "$OUT/grid_barrier.json"
      ;;
    few-rows)
      log "decode layers at 2-16 rows: the few-rows tensor-core kernel against cuBLAS and the norm/SiLU kernels"
      python profiles/bench_few_rows.py --json "$OUT/few_rows.json"
      ;;
    few-rows-norm-after)
      log "decode layers at 2-16 rows: the few-rows kernel with the norm applied after the products (measured tiles)"
      python profiles/bench_few_rows.py --tiles-from profiles/results/few_rows_h200.json \
        --json "$OUT/few_rows_norm_after.json"
      ;;
    gemv-tma)
      log "batch-1 GEMV: register loads against TMA-pipelined weight slices"
      python profiles/bench_gemv_tma.py --json "$OUT/gemv_tma.json"
      ;;
    step-tiles)
      log "batch-1 GEMV tiles timed inside the captured step (change 21)"
      python profiles/bench_step_tiles.py --json "$OUT/step_tiles.json"
      ;;
    attention-floor)
      log "the batch-1 step: the paged decode, without its merge, a bare kernel in its place"
      python profiles/bench_attention_floor.py --json "$OUT/attention_floor.json"
      ;;
    step-attention)
      log "batch-1 split counts and K/V tiles timed inside the captured step, then the short-context rule (change 22)"
      python profiles/bench_step_attention.py --json "$OUT/step_attention.json"
      python profiles/bench_step_attention.py --compare-rule --json "$OUT/short_context_rule.json"
      ;;
    profile)
      for spec in "llama-3.2-1b 1" "llama-3.2-1b 64" "smollm2-135m 1"; do
        set -- $spec
        log "profile $1 batch $2"
        graphrt profile --model "random:$1" --batch-size "$2" --trace "/tmp/trace_$1_$2.json.gz" \
          --json "$OUT/profile_$1_b$2.json" | head -45
      done
      ;;
    profile-8b)
      # The 8B batch-1 step did not speed up with the measured GEMV tiles although its layers did in
      # bench_gemv (notes_fusion.md, "Where it stands"): the step as run (GEMV layers, dependent launches;
      # kernel times include their waits), then plainly launched (its layers then on cuBLAS) to compare.
      for launch in "" "--plain-launch"; do
        log "profile llama-3-8b batch 1 ${launch:-(dependent launches)}"
        graphrt profile --model random:llama-3-8b --batch-size 1 $launch --trace "/tmp/trace_8b_b1$launch.json.gz" \
          --json "$OUT/profile_llama-3-8b_b1${launch:+_plain}.json" | head -45
      done
      ;;
    host)
      python profiles/pinned_copy_probe.py
      for spec in "llama-3.2-1b 1 512 --cprofile" "llama-3.2-1b 64 512" "llama-3.2-1b 64 4096" "smollm2-135m 1 512"; do
        set -- $spec
        python profiles/host_step_breakdown.py --model "random:$1" --batch-size "$2" --context "$3" ${4:-}
      done
      ;;
    nvtx)
      log "NVTX host cost, off and on"
      python profiles/bench_nvtx_overhead.py --json "$OUT/nvtx_overhead_h200.json"
      ;;
  esac
done
log done
