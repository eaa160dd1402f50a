#!/usr/bin/env bash
# The checks of a machine with a CUDA GPU (docs/performance.md, "Devices"), run from the repository root:
#   1. the test suite twice side by side (pytest-xdist): on the CPU, and with QUANTOPT_TEST_DEVICE=cuda, which makes
#      every cfg workflow of the suite compute on the GPU and runs tests/test_device_parity.py;
#   2. benchmarks/device_stages.py: every corpus model stage by stage on the GPU (first differing layer named);
#   3. benchmarks/real_model_speed.py --device cuda: each model on the CPU and on the GPU, speed-ups, equal integers.
# Logs go to $OUT (default /tmp/quantopt-gpu-check). Limits: SUITE_LIMIT_S (default 300) for each suite,
# BENCH_LIMIT_S (default 240) and BENCH_ARGS (default: every model but MiniLM, best of 3) for the benchmark,
# CPU_WORKERS / GPU_WORKERS (default 6 / 9) for the suites. Needs pytest-xdist and pytest-timeout. The PP-OCRv4
# rows need the rapidocr_onnxruntime package or QUANTOPT_BENCH_MODEL_DIR naming a folder with its two ONNX files
# (ch_PP-OCRv4_det_infer.onnx, ch_PP-OCRv4_rec_infer.onnx); without either they are reported as skipped.
set -u
out=${OUT:-/tmp/quantopt-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
nvidia-smi -L
python3 -c 'import torch, numpy; print("torch", torch.__version__, "numpy", numpy.__version__, "cuda", torch.cuda.is_available())'

suite() {  # name, workers, then VAR=value settings for the run
  local name=$1 workers=$2
  shift 2
  # one torch thread per worker: the workers already fill the cores
  env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$@" timeout "${SUITE_LIMIT_S:-300}" python3 -m pytest -p no:cacheprovider \
    -n "$workers" -v -rfE --tb=short --timeout 240 > "$out/suite-$name.log" 2>&1
  echo "exit code $?" >> "$out/suite-$name.log"
}

timeout "${STAGES_LIMIT_S:-120}" python3 benchmarks/device_stages.py --device cuda > "$out/stages.log" 2>&1
echo "device stages exit code $?" >> "$out/stages.log"
grep -E "failing stages|^  [0-9]+ x |exit code" "$out/stages.log" | cut -c1-300

start=$(date +%s)
suite cpu "${CPU_WORKERS:-6}" QUANTOPT_TEST_DEVICE= &
suite cuda "${GPU_WORKERS:-9}" QUANTOPT_TEST_DEVICE=cuda &
wait
echo "suites: $(( $(date +%s) - start )) s"
for name in cpu cuda; do
  echo "== suite on $name: $(grep -E '^=+ .*(passed|failed).* in ' "$out/suite-$name.log" | tail -1) $(tail -1 "$out/suite-$name.log")"
  grep -E '^(FAILED|ERROR) ' "$out/suite-$name.log" | cut -c1-300 | head -60
done
# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
timeout "${BENCH_LIMIT_S:-240}" python3 benchmarks/real_model_speed.py --device cuda \
  ${BENCH_ARGS:---models ppocr_rec_320,ppocr_rec_640,ppocr_det,syn_resnet,syn_mobilenet,ppocr_cls,mtcnn_onet} \
  > "$out/bench.log" 2>&1
echo "benchmark exit code $?" >> "$out/bench.log"
cat "$out/bench.log"
