# Quick start: `make demo` and `make test`. Everything runs on the CPU; nothing is downloaded at run time.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
PIP_QUIET ?= -q
# torch first, pinned: later requirements are then satisfied and pip pulls no other (CUDA) build.
TORCH := torch==2.13.0
NEW_STACK := diffusers==0.42.1 accelerate==1.15.0 "transformers>=5,<6"
OLD_STACK := diffusers==0.32.2 accelerate==1.6.0 transformers==4.51.3
DIFFUSERS_SDIST_VERSION := 0.42.1
BLACK_PATHS := setup.py diffusers_offload_ext tests $(wildcard benchmarks)
PYTEST := -p no:cacheprovider -q

.PHONY: demo test test-serial test-new test-old test-patched lint clean

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

# diffusers v0.42.1 built from its source distribution with patches/ applied; this package is NOT installed.
.venv-patched/.installed: patches/*.patch patches/apply-to-sdist.sh
	rm -rf .venv-patched build/diffusers-patched build/sdist
	$(PYTHON) -m venv .venv-patched
	.venv-patched/bin/pip install $(PIP_QUIET) $(TORCH)
	.venv-patched/bin/pip download $(PIP_QUIET) --no-deps --no-binary :all: -d build/sdist diffusers==$(DIFFUSERS_SDIST_VERSION)
	bash patches/apply-to-sdist.sh build/sdist/diffusers-$(DIFFUSERS_SDIST_VERSION).tar.gz build/diffusers-patched
	.venv-patched/bin/pip install $(PIP_QUIET) ./build/diffusers-patched accelerate==1.15.0 "transformers>=5,<6" sentencepiece protobuf peft pytest hypothesis
	touch $@

demo: .venv/.installed
	.venv/bin/diffusers-offload demo

lint: .venv/.installed
	.venv/bin/black --check $(BLACK_PATHS)

test-new: .venv/.installed
	.venv/bin/pytest $(PYTEST) tests

test-old: .venv-old/.installed
	.venv-old/bin/pytest $(PYTEST) tests

test-patched: .venv-patched/.installed
	.venv-patched/bin/pytest $(PYTEST) tests --offload-impl=patched

# The stacks run side by side (each pytest uses one thread; CI has 2 cores), each one's output printed whole when
# it is done. `make test-serial` runs them one after the other.
JOBS ?= 2
test: lint
	$(MAKE) --no-print-directory -j$(JOBS) --output-sync=target test-new test-old test-patched

test-serial: lint test-new test-old test-patched

clean:
	rm -rf .venv .venv-old .venv-patched build
