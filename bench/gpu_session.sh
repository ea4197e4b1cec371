#!/usr/bin/env bash
# One device call, many steps: GPU tests and benchmarks, each under its own time limit.
# Usage on the GPU machine (repo root):  bash bench/gpu_session.sh STEP[:SECONDS] ...
# Steps: tests memcheck official parity generate attention profile codec-parity codec quantize
# pipeline e2e encode-beside profile-job kernels fused fp8-accumulation gemm-epilogues scaling
# (GPU_TESTS narrows the test paths, MEMCHECK_TESTS the tests run under compute-sanitizer memcheck,
# PIPELINE_ROWS the pipeline bench's rows, E2E_PARTS / E2E_PRECISIONS / E2E_ROWS what the e2e bench runs
# (E2E_PARTS=setup makes its checkpoints, manifests and CUDA extension and measures nothing; timed
# entries merge into bench/results/e2e-<gpu>.json, or E2E_OUT; E2E_WORK a scratch folder kept between
# calls; encode-beside and profile-job reuse E2E_WORK and E2E_ROWS' manifest; PROFILE_JOB_ARGS holds
# profile-job's other arguments, e.g. "--precision fp8 --prepare-threads 1 --out $OUT/profile-1.json"),
# SCALING_GPUS the GPU counts of the scaling bench, one per call: it merges into
# bench/results/scaling-<gpu>.json.)
# Logs and bench/results/*.json come back bundled as $OUT/logs.tgz and $OUT/results.tgz.
set -u
out=${OUT:-/tmp/ovbatch-out}
mkdir -p "$out/logs"
[ -f .devwheels/activate ] && source .devwheels/activate
PY=${PY:-python3}  # the interpreter that has torch (make bench passes the venv's)
export PY PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# .devwheels arrive without .pyc files (installed with --no-compile, Ray untarred): compile them once, as pip
# install does, so that a fresh machine's first job is not charged for compiling Ray's modules.
if [ -d /tmp/site ] && [ ! -e /tmp/site/.compiled ]; then
  $PY -m compileall -q -j 0 /tmp/site > /dev/null; touch /tmp/site/.compiled
fi
# One name for every call on this machine (bench/e2e.py stamps its entries with it): /tmp lives as long as it.
[ -s /tmp/ovbatch-session ] || date -u +%Y-%m-%dT%H:%MZ > /tmp/ovbatch-session
export OVBATCH_SESSION=$(cat /tmp/ovbatch-session)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/logs/gpu.txt" 2>&1

step() {
  case $1 in
    tests)        $PY -m pytest -q -m gpu ${GPU_TESTS:-tests} ;;
    memcheck)     echo "compute-sanitizer --tool memcheck pytest -m gpu ${MEMCHECK_TESTS:-tests/test_kernels.py}"
                  compute-sanitizer --tool memcheck $PY -m pytest -q -m gpu ${MEMCHECK_TESTS:-tests/test_kernels.py} ;;
    official)     $PY -m pytest -q -m official tests ;;
    parity)       $PY bench/parity.py ;;
    generate)     $PY bench/generate.py --reps 3 ;;
    attention)    $PY bench/attention.py ;;
    profile)      $PY bench/profile_generate.py ;;
    codec-parity) $PY bench/codec_parity.py ;;
    codec)        $PY bench/codec.py ;;
    quantize)     $PY bench/quantize.py ;;
    pipeline)     $PY bench/pipeline.py --rows ${PIPELINE_ROWS:-512} ;;
    e2e)          $PY bench/e2e.py --parts ${E2E_PARTS:-official,engine,job_local,job_ray} \
                    --precisions ${E2E_PRECISIONS:-bf16,fp8,w4a4} --rows ${E2E_ROWS:-2000} \
                    ${E2E_OUT:+--out $E2E_OUT} ${E2E_WORK:+--work $E2E_WORK} ;;
    encode-beside) $PY bench/encode_beside.py --rows ${E2E_ROWS:-2000} ${E2E_WORK:+--work $E2E_WORK} ;;
    profile-job)  $PY bench/profile_job.py --rows ${E2E_ROWS:-2000} ${E2E_WORK:+--work $E2E_WORK} \
                    ${PROFILE_JOB_ARGS:-} ;;
    kernels)      $PY bench/kernels.py ;;
    fused)        $PY bench/fused.py ;;
    fp8-accumulation) $PY bench/fp8_accumulation.py ;;
    gemm-epilogues) $PY bench/gemm_epilogues.py ;;
    scaling)      $PY bench/scaling.py --gpus ${SCALING_GPUS:-1} ;;
    *) echo "unknown step $1"; return 2 ;;
  esac
}

for arg in "$@"; do
  name=${arg%%:*}; limit=${arg#*:}; [ "$limit" = "$arg" ] && limit=300
  start=$(date +%s)
  timeout "$limit" bash -c "$(declare -f step); step $name" > "$out/logs/$name.log" 2>&1
  rc=$?
  printf '%-13s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$(tail -n 1 "$out/logs/$name.log")" | tee -a "$out/logs/summary.txt"
done
tar czf "$out/results.tgz" bench/results
tar czf "$out/logs.tgz" -C "$out" logs
