# ARL-Tangram — the commands docs/architecture.md promises.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
export PYTHONPATH := $(CURDIR)/scheduler:$(CURDIR)/operator:$(CURDIR)/node-agent

.PHONY: setup run test test-gpu e2e bench-pods bench-control-plane lint typecheck bench bench-quick gpu-kit images manifests chart-lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The gpu extra (PyTorch, several GB) is left out by default; `make test-gpu` adds it.
EXTRAS ?= $(or $(TANGRAM_EXTRAS),dev)

setup: $(BIN)/python ## create .venv with the project and its dev tools installed
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'

LINTED := conftest.py scheduler operator node-agent tests e2e

lint: setup
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/lint-imports

TYPED := scheduler/tangram node-agent/tangram operator/tangram tests e2e

typecheck: setup
	$(BIN)/mypy $(TYPED)

# auto is Docker; RUNTIME=process runs commands on this host, unisolated (README).
RUNTIME ?= auto
# `make run PORT=8081` when 8080 is taken; clients then need TANGRAM_URL=http://127.0.0.1:8081.
PORT ?= 8080

run: setup ## the embedded default: scheduler + local node agent serving manifests/examples/local
	$(BIN)/tangram up -f manifests/examples/local --runtime $(RUNTIME) --port $(PORT)

test: setup lint typecheck ## lint, type-check and run the whole test suite
	$(BIN)/pytest -n 2 --dist loadgroup -q

test-gpu: ## the tests that need PyTorch (the gpu extra, several GB), on the CPU; CUDA ones skip
	$(MAKE) setup EXTRAS=dev,gpu
	$(BIN)/mypy $(TYPED)  # the GPU worker type-checks against PyTorch's own stubs too
	$(BIN)/pytest -n 2 --dist loadgroup -q -m torch

e2e: setup ## end to end on a real control plane built from the Go module proxy (e2e/README.md)
	bash e2e/build-tools.sh
	$(BIN)/pytest e2e -v -p no:cacheprovider

HELM ?= $(shell bash e2e/build-tools.sh 2>/dev/null | tail -n 1)/helm

images: ## the operator, scheduler and node-agent images, built without pulling (docs/install.md)
	images/build.sh

manifests: setup ## regenerate crds/, the chart's CRD templates and manifests/install.yaml
	$(BIN)/tangram crds
	HELM=$(HELM) charts/render-install.sh

chart-lint: ## helm lint --strict of the chart
	$(HELM) lint --strict charts/arl-tangram

bench: setup ## the benchmarks recorded in docs/benchmarks.md
	$(BIN)/tangram bench scheduler --json --out docs/bench/scheduler.json
	$(BIN)/tangram bench paper --out docs/bench
	$(BIN)/tangram bench coding-seeds --out docs/bench/coding-seeds.json
	$(BIN)/tangram bench gpu-seeds --out docs/bench/gpu-seeds.json
	$(BIN)/tangram bench search-seeds --out docs/bench/search-seeds.json
	$(BIN)/tangram bench exec --json --out docs/bench/exec.json  # needs a Docker Engine
	$(BIN)/python e2e/bench_pods.py  # the pod runtime on a real kubelet: root, containerd
	$(BIN)/python e2e/bench_control_plane.py  # a real kube-scheduler's binding rate
	$(BIN)/tangram bench service --sweep 2,1,0.7,0.5,0.48,0.45,0.4,0.33,0.25,0.2,0.16,0.13,0.1 --json --out docs/bench/service.json
	$(BIN)/tangram bench service --transport http --sweep 2,1,0.7,0.5,0.48,0.45,0.4,0.33,0.28,0.25,0.2 --json --out docs/bench/service_http.json
	$(BIN)/tangram bench tenants --json --out docs/bench/tenants.json
	$(BIN)/tangram bench files --json --out docs/bench/files.json  # needs a Docker Engine
	@if $(BIN)/python -c 'import torch' 2>/dev/null; then \
		$(BIN)/tangram bench gpu --json --out docs/bench/gpu.json && \
		$(BIN)/tangram bench gpu-pool --json --out docs/bench/gpu_pool.json; \
	else echo "skipping bench gpu and gpu-pool: no PyTorch (make setup EXTRAS=dev,gpu)"; fi

# What a lent GPU machine lacks: its python3 (3.12) holds PyTorch and most of the rest, and
# it reaches no registry, so these travel as wheels in .whl/ (docs/gpu.md, tests/gpu-device.sh);
# typing_extensions too, as pydantic needs a newer one than its image may hold.
GPU_KIT := pydantic pydantic_core annotated_types typing_inspection docker fastapi starlette \
	uvicorn httptools websockets python-multipart opentelemetry-api typing_extensions
GPU_PLATFORMS := $(foreach n,2_17 2_24 2_27 2_28 2_31 2_34 2_35,--platform manylinux_$(n)_x86_64) \
	--platform manylinux2014_x86_64 --platform manylinux1_x86_64

gpu-kit: setup ## wheels (cp312, the versions in .venv) a lent GPU machine lacks, into .whl/
	rm -rf .whl && mkdir -p .whl
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(GPU_PLATFORMS) -d .whl $$($(BIN)/python -c \
		"import importlib.metadata as m; print(*(f'{n}=={m.version(n)}' for n in '$(GPU_KIT)'.split()))")
	@du -sh .whl

bench-pods: setup ## the pod runtime's overhead and open latency on a real kubelet (root)
	$(BIN)/python e2e/bench_pods.py

bench-control-plane: setup ## how fast a real kube-scheduler binds a batch of trajectory pods
	$(BIN)/python e2e/bench_control_plane.py

bench-quick: setup ## a smaller paper sweep for a smoke run (writes out/bench)
	$(BIN)/tangram bench paper --quick --out out/bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build *.egg-info
