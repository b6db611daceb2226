# Quick start: `make demo` and `make test`. Everything runs on the CPU; nothing is downloaded at run time.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
PIP_QUIET ?= -q
# torch first, pinned: later requirements are then satisfied and pip pulls no other (CUDA) build.
TORCH := torch==2.13.0
NEW_STACK := diffusers==0.42.1 accelerate==1.15.0 "transformers>=5,<6"
OLD_STACK := diffusers==0.32.2 accelerate==1.6.0 transformers==4.51.3
# The quantization libraries users load FLUX with (bitsandbytes has a CPU backend since 0.48), for tests/test_quantized*.
QUANT_LIBS := bitsandbytes==0.50.2 gguf==0.19.0 torchao==0.18.0 optimum-quanto==0.2.7
DIFFUSERS_SDIST_VERSION := 0.42.1
# The upstream patch series (patches/fixes, then patches/main or its backport patches/v0.42.1) are checked with
# diffusers' own pinned tools, against the PyPI sdists of 0.42.1 and 0.40.0 (whose pipeline_utils.py is the fetched
# main's); see patches/README.md.
# (hf-doc-builder imports requests without requiring it)
PATCH_TOOLS := ruff==0.9.10 hf-doc-builder==0.5.0 requests
PATCH_SDISTS := build/sdist/diffusers-0.42.1.tar.gz build/sdist/diffusers-0.40.0.tar.gz
BLACK_PATHS := setup.py diffusers_offload_ext tests $(wildcard benchmarks tools)
PYTEST := -p no:cacheprovider -q

.PHONY: demo test test-serial test-new test-old test-patched test-quant lint clean check-patches test-patch-diffusers gpu-check

.venv/.installed: setup.py
	rm -rf .venv
	$(PYTHON) -m venv .venv
	.venv/bin/pip install $(PIP_QUIET) $(TORCH)
	.venv/bin/pip install $(PIP_QUIET) -e ".[test]" $(NEW_STACK)
	touch $@

.venv-old/.installed: setup.py
	rm -rf .venv-old
	$(PYTHON) -m venv .venv-old
	.venv-old/bin/pip install $(PIP_QUIET) $(TORCH)
	.venv-old/bin/pip install $(PIP_QUIET) -e ".[test]" $(OLD_STACK)
	touch $@

# The newest stack and the quantization libraries: every backend under every option (tests/test_quantized*.py).
.venv-quant/.installed: setup.py
	rm -rf .venv-quant
	$(PYTHON) -m venv .venv-quant
	.venv-quant/bin/pip install $(PIP_QUIET) $(TORCH)
	.venv-quant/bin/pip install $(PIP_QUIET) -e ".[test]" $(NEW_STACK) $(QUANT_LIBS)
	touch $@

# ruff and hf-doc-builder at the versions diffusers uses, to check the patch series; also downloads the sdists.
.venv-patch-tools/.installed:
	rm -rf .venv-patch-tools
	$(PYTHON) -m venv .venv-patch-tools
	.venv-patch-tools/bin/pip install $(PIP_QUIET) $(PATCH_TOOLS)
	touch $@

build/sdist/diffusers-%.tar.gz: | .venv-patch-tools/.installed
	.venv-patch-tools/bin/pip download $(PIP_QUIET) --no-deps --no-binary :all: -d build/sdist diffusers==$*

# diffusers v0.42.1 built from its source distribution with patches/fixes and patches/v0.42.1 applied; this package
# is NOT installed.
.venv-patched/.installed: patches/fixes/*.patch patches/v0.42.1/*.patch patches/apply-to-sdist.sh build/sdist/diffusers-$(DIFFUSERS_SDIST_VERSION).tar.gz
	rm -rf .venv-patched build/diffusers-patched
	$(PYTHON) -m venv .venv-patched
	.venv-patched/bin/pip install $(PIP_QUIET) $(TORCH)
	bash patches/apply-to-sdist.sh build/sdist/diffusers-$(DIFFUSERS_SDIST_VERSION).tar.gz build/diffusers-patched patches/fixes patches/v0.42.1
	.venv-patched/bin/pip install $(PIP_QUIET) ./build/diffusers-patched accelerate==1.15.0 "transformers>=5,<6" sentencepiece protobuf peft pytest hypothesis
	touch $@

# The GPU check in one command, on a machine with a CUDA GPU (docs/benchmarks-gpu.md): results into GPU_RESULTS within
# GPU_SECONDS. Not part of `test`: it needs no venv of ours (PYTHON names the interpreter, with torch and diffusers).
GPU_RESULTS ?= gpu-results
GPU_SECONDS ?= 540
gpu-check:
	tools/gpu_check.sh $(GPU_RESULTS) $(GPU_SECONDS)

demo: .venv/.installed
	.venv/bin/diffusers-offload demo

lint: .venv/.installed
	.venv/bin/black --check $(BLACK_PATHS)

test-new: .venv/.installed
	.venv/bin/pytest $(PYTEST) tests

test-old: .venv-old/.installed
	.venv-old/bin/pytest $(PYTEST) tests

# Only the quantized tests: the rest of the suite runs in test-new on the same stack.
test-quant: .venv-quant/.installed
	.venv-quant/bin/pytest $(PYTEST) tests/test_quantized.py tests/test_quantized_matrix.py

test-patched: .venv-patched/.installed
	.venv-patched/bin/pytest $(PYTEST) tests --offload-impl=patched

# Both series apply with plain `git am` to their bases; ruff and doc-builder pass on what they change.
# Add DIFFUSERS_REPO=/path/to/a/diffusers/clone for the full check against real trees (not possible in CI).
check-patches: .venv-patch-tools/.installed $(PATCH_SDISTS)
	.venv-patch-tools/bin/python patches/check_series.py --sdist-dir build/sdist --work build/check-patches \
		$(if $(DIFFUSERS_REPO),--diffusers-repo $(DIFFUSERS_REPO))

# The series' own diffusers-style tests (tests/pipelines/test_pipelines_model_cpu_offload.py of the patched sdist
# tree; the sdist has no tests/__init__.py, which the relative imports need) against the patched build; then the
# fixes' tests (`-k Arguments`) against the sdist's own src/ as released: every one of them must fail there.
test-patch-diffusers: .venv-patched/.installed
	touch build/diffusers-patched/tests/__init__.py build/diffusers-patched/tests/pipelines/__init__.py
	cd build/diffusers-patched && ../../.venv-patched/bin/pytest $(PYTEST) --rootdir=. -rs tests/pipelines/test_pipelines_model_cpu_offload.py
	rm -rf build/diffusers-released && mkdir -p build/diffusers-released
	git -C build/diffusers-patched archive "$$(git -C build/diffusers-patched rev-list --max-parents=0 HEAD)" src | tar -x -C build/diffusers-released
	cd build/diffusers-patched && PYTHONPATH=$(CURDIR)/build/diffusers-released/src ../../.venv-patched/bin/pytest $(PYTEST) \
		--rootdir=. -k Arguments tests/pipelines/test_pipelines_model_cpu_offload.py > ../released.log 2>&1; \
		echo "the fixes' tests against diffusers $(DIFFUSERS_SDIST_VERSION) as released: $$(tail -n 1 ../released.log)"; \
		grep -q " failed" ../released.log && ! grep -q " passed" ../released.log

# Everything runs side by side (each pytest uses one thread; CI has 2 cores), each target's output printed whole
# when it is done. `make test-serial` runs them one after the other.
CHECKS := test-new test-old test-patched test-quant check-patches test-patch-diffusers
JOBS ?= 2
test: lint
	$(MAKE) --no-print-directory -j$(JOBS) --output-sync=target $(CHECKS)

test-serial: lint $(CHECKS)

clean:
	rm -rf .venv .venv-old .venv-patched .venv-patch-tools .venv-quant build
