#!/usr/bin/env bash
# One prepared run on a lent GPU machine, everything that needs a GPU in one go (about 8
# minutes on one H200): the wheels fetched by benchmarks/gpu_wheels.sh, the machine's NCCL, then
# python -m titanext.gpucheck with every row group (arguments go to it), then the side-by-side
# benchmark (benchmarks/side_by_side.py; SIDE_BY_SIDE=0 skips it); JSON and logs under $OUT, or
# ./gpu_out.
#   here:  bash benchmarks/gpu_wheels.sh
#   there: bash benchmarks/gpu_session.sh         (carry .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the side-by-side's traced titanext step, its top ops and its CUDA memory snapshot go here too
export TITANEXT_GPUCHECK_OUT="$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/titanext-site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/titanext-site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv | tee "$out/machine.txt"
python3 -c "import torch; print('torch', torch.__version__, 'NCCL', torch.cuda.nccl.version())" \
  | tee -a "$out/machine.txt"
timeout "${GPUCHECK_TIMEOUT:-300}" python3 -m titanext.gpucheck --json "$out/gpucheck.json" \
  --markdown "$@" 2>&1 | tee "$out/gpucheck.log"
if [ "${SIDE_BY_SIDE:-1}" != 0 ]; then
  timeout "${SIDE_BY_SIDE_TIMEOUT:-180}" python3 benchmarks/side_by_side.py \
    --json "$out/side_by_side.json" --markdown 2>&1 | tee "$out/side_by_side.log"
fi
