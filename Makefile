# llmserve — the two commands a new user needs: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROTO_SRC := $(wildcard protos/llmserve/v1/*.proto)
PROTO_OUT := llmserve/v1
# The Node.js client test's project (tests/test_node_client.py).
NODE_DIR := tests/node
# Where the launcher keeps the converted default model (see tools/model_store.py).
export LLMSERVE_CACHE_DIR ?= $(HOME)/.cache/llmserve
# The torch of `make setup` (its CPU build) and of the inference images (CUDA or CPU build).
TORCH_VERSION := 2.13.0

.PHONY: setup protos node-client redis-server proto-baseline serve test test-fast fuzz bench images images-smoke lint-images clean help

help:  ## List the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77"
	# The CPU build of torch, pinned: an unpinned torch pulls several GB of CUDA.
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	# llmserve/v1 (generated, see `protos`) is a declared package: it must exist to install.
	mkdir -p $(PROTO_OUT) && touch $(PROTO_OUT)/__init__.py
	$(PY) -m pip install -q --no-build-isolation -e '.[dev,redis,bench,structured]'
	touch $@

setup: $(VENV)/.installed protos node-client redis-server  ## Create .venv with everything installed and protos built

# Optional: without npm, `make serve` still works and the Node client test is skipped.
node-client:  ## Install the Node.js client test's packages (npm ci, when npm is installed)
	@if command -v npm >/dev/null; then $(MAKE) --no-print-directory $(NODE_DIR)/node_modules/.installed; \
	else echo "npm not found: the Node.js client test will be skipped"; fi
$(NODE_DIR)/node_modules/.installed: $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json
	cd $(NODE_DIR) && npm ci --no-audit --no-fund
	touch $@

# Optional: the routing-index and tokenization-cache tests start a real redis-server on loopback;
# without one (and no apt-get to install it) they are skipped. `make serve` never needs Redis.
redis-server:  ## Install redis-server from Debian packages when missing (root or sudo)
	@if command -v redis-server >/dev/null; then :; \
	elif command -v apt-get >/dev/null && { [ "$$(id -u)" -eq 0 ] || sudo -n true 2>/dev/null; }; then \
	  S=$$([ "$$(id -u)" -eq 0 ] || echo sudo); $$S apt-get install -y -q redis-server >/dev/null 2>&1 || \
	  { $$S apt-get update -q >/dev/null && $$S apt-get install -y -q redis-server >/dev/null; }; \
	else echo "redis-server not found and cannot be installed: the Redis tests will be skipped"; fi

# Generated code is never committed: this target rebuilds it into llmserve/v1/.
protos: $(PROTO_OUT)/.built  ## Generate Python code from protos/
$(PROTO_OUT)/.built: $(PROTO_SRC) $(VENV)/.installed
	mkdir -p $(PROTO_OUT)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)
	touch $(PROTO_OUT)/__init__.py $@

# The contract clients were given, for `buf breaking` (tests/test_buf.py): refresh it only when
# a break is intended, and say so in the commit (buf.yaml).
proto-baseline: $(VENV)/.installed  ## Refresh protos/buf-baseline.json from protos/ (an intended break)
	$(VENV)/bin/buf build --exclude-source-info -o '-#format=json' | $(PY) -m json.tool --indent 1 > protos/buf-baseline.json

serve: setup  ## Serve the default model (SmolLM2-135M-Instruct) (gRPC on localhost:50051, OpenAI HTTP on :8000)
	$(VENV)/bin/llmserve serve $(SERVE_ARGS)

test: setup  ## Run the whole test suite (starts real servers on loopback)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: setup  ## Tests that do not need the real default model
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# tests/test_fuzz.py at full size: new random cases each run, FUZZ_EXAMPLES per public method (`make
# test` runs 150 each, the same every run). No per-test timeout: a method's 10,000 cases take minutes,
# and each call has its own hang guard.
FUZZ_EXAMPLES ?= 10000
fuzz: setup  ## Fuzz every public method of the three services with FUZZ_EXAMPLES (10,000) cases each
	LLMSERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) LLMSERVE_FUZZ_RANDOM=1 $(PY) -m pytest -q -rP --timeout 0 \
	  tests/test_fuzz.py $(PYTEST_ARGS)

# The images (deploy/docker/Dockerfile, one target per service), tagged with pyproject's version,
# built by deploy/docker/build-images.sh: on the registry's Python base where it can be pulled,
# else on one made from Debian's packages; the CPU torch from pip's find-links where they hold it;
# the CUDA image where PyTorch's index answers. BAKE_DEFAULT_MODEL=1 puts the default model's
# wheel into them, for clusters without PyPI. See deploy/docker/README.md.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
BAKE_DEFAULT_MODEL ?= 0

images:  ## Build llmserve/{gateway,preprocess,inference-cpu}:VERSION, and inference:VERSION where its index answers (needs Docker)
	deploy/docker/build-images.sh $(VERSION) $(TORCH_VERSION) $(BAKE_DEFAULT_MODEL)

# Builds the images, then runs each one and the chart's pods from them (tests/test_images_run.py,
# tests/test_helm_runs.py); starts dockerd itself when none answers. LLMSERVE_IMAGES=1: fail, not
# skip, where Docker is missing.
images-smoke: setup  ## Build the images and run each one, and the chart's CPU pods, from them (needs Docker)
	LLMSERVE_IMAGES=1 $(PY) -m pytest -q -rP tests/test_images_run.py \
	  "tests/test_helm_runs.py::test_the_cpu_values_run_from_the_images" $(PYTEST_ARGS)

lint-images: $(VENV)/.installed  ## Lint the Dockerfile with hadolint (no Docker needed)
	$(VENV)/bin/hadolint --config .hadolint.yaml deploy/docker/Dockerfile

clean:  ## Remove generated code and the virtualenv
	rm -rf $(PROTO_OUT) $(VENV) *.egg-info $(NODE_DIR)/node_modules
