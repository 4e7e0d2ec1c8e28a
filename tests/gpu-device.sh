#!/usr/bin/env bash
# Issue #6's CUDA checks on a lent GPU machine (docs/gpu.md, "On a lent GPU machine"):
# the gpu-marked tests, the restore-bandwidth bench and the pooled-vs-static bench.
# Run it from the repository root there, with .whl/ (`make gpu-kit`) carried along; its
# python3 must hold PyTorch with CUDA. Results go to $OUT (or out/gpu); exits non-zero
# if a step failed, after running the others.
set -uo pipefail
out=${OUT:-out/gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        .whl/*.whl || exit 1
    export PYTHONPATH=$site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/scheduler:$PWD/node-agent:$PWD/operator
export PYTHONUNBUFFERED=1
failed=()
step() {  # step NAME COMMAND...: run it, its output in $out/NAME.log
    echo "== $1"
    "${@:2}" 2>&1 | tee "$out/$1.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("$1")
}
step nvidia-smi nvidia-smi
step cuda "$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; \
print(torch.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))"
step pytest-gpu "$py" -m pytest -m gpu -v -p no:cacheprovider tests
step bench-gpu "$py" -m tangram.cli.main bench gpu --json --out "$out/gpu.json"
step bench-gpu-pool "$py" -m tangram.cli.main bench gpu-pool --json --out "$out/gpu_pool.json"
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all GPU checks passed; results in $out"
