#!/usr/bin/env bash
# The CUDA checks on a lent GPU machine (docs/gpu.md, "On a lent GPU machine"): the GPU
# worker's tests on the device, the service's CUDA tests, the restore-bandwidth bench (1 and
# 4 GiB) and the pooled-vs-static bench (modeled compute; real decode steps, batched and
# not). Run it from the repository root there, with .whl/
# (`make gpu-kit`) carried along; its python3 must hold PyTorch with CUDA. Each step's
# output goes to $OUT/device.log (or out/gpu), the JSON reports beside it (at most seven
# files: the lent machine returns eight). Each step has its own time limit, so one that
# hangs leaves time for the rest; exits non-zero if a step failed, after running the others.
# Steps named as arguments run alone (`bash tests/gpu-device.sh pytest-gpu`), for a rerun.
set -uo pipefail
only=" $* "
out=${OUT:-out/gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
log=$out/device.log
if compgen -G ".whl/*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        .whl/*.whl || exit 1
    export PYTHONPATH=$site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/scheduler:$PWD/node-agent:$PWD/operator
export PYTHONUNBUFFERED=1
failed=()
step() {  # step NAME SECONDS COMMAND...: run it within SECONDS, its output into the log
    [ "$only" = "  " ] || [[ "$only" == *" $1 "* ]] || return 0
    echo "== $1 ($(date -u +%H:%M:%S))" | tee -a "$log"
    timeout --kill-after=10 "$2" "${@:3}" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { failed+=("$1"); echo "== $1 failed: exit $rc" | tee -a "$log"; }
}
step nvidia-smi 30 nvidia-smi
step cuda 60 "$py" -c "import platform, torch; assert torch.cuda.is_available(), 'no CUDA'; \
print('Python', platform.python_version(), 'torch', torch.__version__, 'CUDA', torch.version.cuda, \
torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0), \
torch.cuda.get_device_properties(0).total_memory // 2**20, 'MiB'); import os; print(os.cpu_count(), 'cores')"
step bench-gpu 150 "$py" -m tangram.cli.main bench gpu --json --out "$out/gpu.json"
step bench-gpu-4g 200 "$py" -m tangram.cli.main bench gpu --json --size-mb 4096 \
    --out "$out/gpu_4g.json"
step bench-gpu-pool 240 "$py" -m tangram.cli.main bench gpu-pool --json --out "$out/gpu_pool.json"
# Real compute (decode steps), calls batched 16 at once on an instance, then one at a time.
for b in 16 1; do
    step "bench-gpu-pool-decode-b$b" 240 "$py" -m tangram.cli.main bench gpu-pool --json \
        --compute decode --batch "$b" --rounds 4 --out "$out/gpu_pool_decode_b$b.json"
done
# The GPU worker's tests run on the device where CUDA is there (test_gpu_worker.py); the
# service's on CPU-backed devices but for the ones marked gpu. Only these files: the rest of
# the suite needs what this machine lacks (kopf, the kubernetes client, a Docker Engine).
step pytest-gpu 300 "$py" -m pytest -p no:cacheprovider -q -n 8 --dist loadgroup \
    -m "torch or gpu" --junitxml "$out/pytest.xml" \
    tests/integration/test_gpu_worker.py tests/integration/test_service_gpu.py \
    tests/integration/test_service_gpu_edits.py tests/integration/test_gpu_role.py \
    tests/integration/test_bench_gpu_pool.py tests/unit/test_gpu_options.py
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}" | tee -a "$log"
    exit 1
fi
echo "all GPU checks passed; results in $out" | tee -a "$log"
