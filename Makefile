# Two commands set everything up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP   = $(VENV)/.specpipe-installed-$(BACKEND)

# llama-cpp-python is compiled from source (~5 minutes on 2 cores) for one
# BACKEND: cpu (the default), cuda, metal or vulkan (docs/backends.md):
#   make install BACKEND=vulkan
# llama.cpp's llamafile kernels are off in every build, and on x86 so are AMX's:
# * AMX: on CPUs with Intel AMX (Sapphire Rapids) ggml's AMX matrix kernel
#   crashes (SIGSEGV in ggml_backend_amx_mul_mat) on any batch of 2+ tokens,
#   in plain llama_cpp.Llama too.
# * llamafile's tinyBLAS (GGML_LLAMAFILE): used only for batches of 2+ tokens,
#   it sums in another order than the single-token kernels, so a batch's
#   logits differed from one-token-at-a-time decoding by up to 0.82 here.
#   Without it they are bit-identical, which exact speculative verification
#   (many tokens per pass, compared with plain decoding) relies on. A GPU
#   backend has batch kernels of its own: there the bench reports agreement.
# The wheel is kept in a cache folder keyed by version, backend and flags: a
# repeat install, or a fresh clone on the same machine, reuses it and takes
# seconds. (pip's own wheel cache ignores CMAKE_ARGS, so it could hand back a
# wheel built without these flags.) orchestrate reports the backend it finds
# (ggml's devices, stages/backend.py), not the one asked for here.
BACKEND       ?= cpu
LLAMA_VERSION := 0.3.36
ifeq ($(filter x86_64 amd64,$(shell uname -m)),)
LLAMA_CFLAGS  :=
else
LLAMA_CFLAGS  := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
endif
CUDA_ARCHITECTURES ?= native
BACKEND_FLAGS_cpu    :=
BACKEND_FLAGS_cuda   := -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCHITECTURES)
BACKEND_FLAGS_metal  := -DGGML_METAL=ON
BACKEND_FLAGS_vulkan := -DGGML_VULKAN=ON
ifeq ($(filter cpu cuda metal vulkan,$(BACKEND)),)
$(error BACKEND=$(BACKEND): choose cpu, cuda, metal or vulkan)
endif
BACKEND_FLAGS := $(BACKEND_FLAGS_$(BACKEND))
# more CMake switches for llama.cpp, e.g. newer Vulkan headers than the system's:
#   make install BACKEND=vulkan LLAMA_CMAKE_ARGS=-DVulkan_INCLUDE_DIR=/opt/vulkan-headers/include
LLAMA_CMAKE_ARGS ?=
BACKEND_TAG   := $(if $(filter cpu,$(BACKEND)),,-$(BACKEND)$(if $(filter cuda,$(BACKEND)),-$(CUDA_ARCHITECTURES)))
WHEEL_CACHE   ?= $(HOME)/.cache/specpipe/wheels
LLAMA_WHEELS  := $(WHEEL_CACHE)/llama-cpp-python-$(LLAMA_VERSION)$(BACKEND_TAG)-noamx-nollamafile
LLAMA_BUILT   := $(LLAMA_WHEELS)/.complete

.PHONY: install run serve test test-system test-tools test-fast mutation peers bench bench-serve chaos chaos-hosts calibrate device-bundle device-check clean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(LLAMA_BUILT): | $(BIN)/python
	@echo "Building llama-cpp-python $(LLAMA_VERSION) for BACKEND=$(BACKEND) from source (about 5 minutes on 2 cores for the CPU)..."
	rm -rf $(LLAMA_WHEELS).partial
	CMAKE_ARGS='-DGGML_LLAMAFILE=OFF $(BACKEND_FLAGS) $(LLAMA_CMAKE_ARGS) -DCMAKE_C_FLAGS="$(LLAMA_CFLAGS)" -DCMAKE_CXX_FLAGS="$(LLAMA_CFLAGS)"' \
	CMAKE_BUILD_PARALLEL_LEVEL=2 \
	$(BIN)/python -m pip wheel --quiet --no-deps --no-cache-dir -w $(LLAMA_WHEELS).partial llama-cpp-python==$(LLAMA_VERSION)
	rm -rf $(LLAMA_WHEELS) && mv $(LLAMA_WHEELS).partial $(LLAMA_WHEELS)
	touch $(LLAMA_BUILT)

$(STAMP): pyproject.toml $(LLAMA_BUILT)
	$(BIN)/python -m pip install --quiet $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl
	# the same version built differently may be installed already: replace it
	$(BIN)/python -m pip install --quiet --force-reinstall --no-deps $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl
	$(BIN)/python -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.specpipe-installed $(VENV)/.specpipe-installed-*  # another backend's wheel is replaced
	touch $(STAMP)

run: install
	$(BIN)/orchestrate run

# The default model as an OpenAI-compatible service on http://127.0.0.1:8000/v1
# (Ray Serve; Ctrl-C stops it). README and docs/serving.md show curl and the openai client.
serve: install
	$(BIN)/orchestrate serve

# tests/hosts/test_ray_up.py brings cluster.yaml up with `ray up` against two sshd
# instances; it needs openssh-server and rsync. Where they are missing and
# this user may install Debian packages (root with apt-get), they are
# installed here; elsewhere that test skips and says why.
test-tools:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    ! { [ -x /usr/sbin/sshd ] && command -v rsync >/dev/null 2>&1; }; then \
	  echo "installing openssh-server and rsync for tests/hosts/test_ray_up.py..."; \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server rsync >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server rsync >/dev/null 2>&1; }; } || \
	  echo "could not install openssh-server and rsync: tests/hosts/test_ray_up.py will skip"; \
	fi

# Two pytest-xdist workers: a test file stays on one worker, the host tests
# all on one (tests/conftest.py); TEST_WORKERS=0 runs them in this process.
# Three were slower on 2 cores (27.8 minutes against two's 23.7 for the
# whole suite on 2026-12-07) and the load kept Ray from starting on the
# namespace hosts (docs/testing.md).
TEST_WORKERS ?= 2

# `make test`: every test but the end-to-end scenarios across machines
# (the `system` marker, pyproject.toml); `make test-system` runs those: the
# namespace hosts and `ray up` (the hosts tier), machines lost, servers under
# load. CI (.ci/run) runs both.
test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not system"

test-system: install test-tools
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m system

# The pure tier only (numpy / pure Python: no model file, no llama.cpp, no Ray):
# about two minutes. A test's tier is its directory, tests/pure/, model/, ray/
# or hosts/, and tests/conftest.py gives it that marker (pyproject.toml);
# `make test` and `make test-system` run every tier between them. `-m pure`
# over all of tests/ rather than `pytest tests/pure`: it collects every file,
# so a test file outside the tier directories is refused here too instead of
# running in no tier.
test-fast: install
	$(BIN)/python -m pytest -m pure -q

# Mutation testing of the pure packages against the pure tier (issue 14; not in
# `make test`: it takes about 40 minutes on 2 cores, docs/testing.md "Mutation testing").
# mutmut ([tool.mutmut] in pyproject.toml) works in mutants/ (git-ignored), a
# worker per core, each mutant
# against the pure tests that call its function; then the killed share per
# module, with the equivalent survivors of tests/mutation_equivalents.md set
# apart. Started afresh each time: results of an earlier run are not trusted.
MUTATION_STAMP := $(VENV)/.specpipe-mutation-installed

$(MUTATION_STAMP): pyproject.toml $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,mutation]'
	touch $(MUTATION_STAMP)

mutation: $(MUTATION_STAMP)
	rm -rf mutants
	$(BIN)/mutmut run
	$(BIN)/python tools/mutation_report.py

# llama.cpp's own C++ tools, the peers `orchestrate bench` sets beside this
# project (docs/measurements.md "Peers"): built from the very llama.cpp source that
# llama-cpp-python $(LLAMA_VERSION) vendors (its sdist from PyPI), with the same
# kernels off (no AMX, no llamafile), static, into the cache folder. About 10
# minutes on 2 cores; not part of `make test`. The bench finds them there.
PEERS       ?= $(HOME)/.cache/specpipe/peers/llama.cpp-$(LLAMA_VERSION)-noamx-nollamafile
PEERS_BUILT := $(PEERS)/.complete
PEER_TOOLS  := ggml-rpc-server llama-server llama-lookup llama-bench

peers: $(PEERS_BUILT)

$(PEERS_BUILT): | $(BIN)/python
	@echo "Building llama.cpp's $(PEER_TOOLS) from llama-cpp-python $(LLAMA_VERSION)'s source (about 10 minutes on 2 cores)..."
	rm -rf $(PEERS).partial && mkdir -p $(PEERS).partial/source
	$(BIN)/python -m pip download --quiet --no-binary :all: --no-deps -d $(PEERS).partial/source llama-cpp-python==$(LLAMA_VERSION)
	tar -xzf $(PEERS).partial/source/llama_cpp_python-$(LLAMA_VERSION).tar.gz -C $(PEERS).partial/source
	cmake -S $(PEERS).partial/source/llama_cpp_python-$(LLAMA_VERSION)/vendor/llama.cpp -B $(PEERS).partial/build \
	  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_RPC=ON -DGGML_LLAMAFILE=OFF -DGGML_NATIVE=ON \
	  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_C_FLAGS="$(LLAMA_CFLAGS)" -DCMAKE_CXX_FLAGS="$(LLAMA_CFLAGS)" >/dev/null
	cmake --build $(PEERS).partial/build -j2 --target $(PEER_TOOLS) >/dev/null
	mkdir -p $(PEERS).partial/bin
	for tool in $(PEER_TOOLS); do cp $(PEERS).partial/build/bin/$$tool $(PEERS).partial/bin/ || exit 1; done
	rm -rf $(PEERS).partial/source $(PEERS).partial/build
	rm -rf $(PEERS) && mv $(PEERS).partial $(PEERS)
	touch $(PEERS_BUILT)

# Every mode side by side on every scenario (benchmarks/scenarios), into
# benchmarks/results: results.json, results.md (docs/measurements.md tables), chart.png.
bench: install
	$(BIN)/orchestrate bench --out benchmarks/results

# Servers under concurrent load (docs/measurements.md "Serving under load"): this server with 2 stages
# and whole, and llama-cpp-python's own server; serve.json, serve.md, serve.png.
bench-serve: install
	$(BIN)/orchestrate bench --serve --out benchmarks/results

# The chaos soak (docs/measurements.md "Chaos soak"): serve with the bench's draft under load while
# stage processes, the replica, a node and drafters are killed, a stage and a drafter stall and
# strangers write to a stage's port; chaos.json.
chaos: install
	$(BIN)/python -m benchmarks.chaos --out benchmarks/results/chaos

# The same across three network namespace hosts (as root), a stage's link cut for 8 s and once for good
# instead of a node removed (benchmarks/chaos_hosts.py).
chaos-hosts: install
	$(BIN)/python -m benchmarks.chaos --hosts --out benchmarks/results/chaos-hosts

# Planner against measurement (docs/planning.md): profile this
# machine, run the bench suite, and put the simulation's predictions beside it.
calibrate: install
	$(BIN)/orchestrate profile --out benchmarks/results/profile.json
	$(BIN)/orchestrate bench --out benchmarks/results
	$(BIN)/python -m benchmarks.calibrate --profile benchmarks/results/profile.json \
	    --bench benchmarks/results/results.json --out benchmarks/results/calibration.md

# The device check (docs/backends.md "The device check"): `make device-bundle`
# here puts what a GPU machine without a network needs into .device/ (a
# trimmed llama-cpp-python source, gguf's wheel; 3.5 MiB); there,
# `make device-check` (or tools/device_check.sh build, then run OUT, as two
# calls) builds the CUDA wheel and measures into $(DEVICE_OUT). Its CPU form
# runs in `make test` (tests/model/test_device_check.py).
DEVICE_OUT ?= device-check

device-bundle: | $(BIN)/python
	$(BIN)/python tools/device_bundle.py .device

device-check:
	tools/device_check.sh build
	tools/device_check.sh run $(DEVICE_OUT)

clean:
	rm -rf $(VENV) build *.egg-info
