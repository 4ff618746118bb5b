# The README's two commands: `make demo` (main job) and `make test` (test suite).
# Both create .venv with Python 3.12 when it is missing and install the package into it.

PYTHON ?= python3.12
# An existing environment can stand in for .venv (e.g. the image's on a GPU machine without a package registry):
#   make test VENV=/opt/torch/.venv PIP_ARGS="--no-index --no-deps --no-build-isolation"
VENV ?= .venv
PIP_ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers: one per core, and at least 4. Most long tests wait on interpreters they start (ranks, tools,
# make targets), so on a 2-core machine 2 workers leave the cores idle ~40% of the time; 4 fill them.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? 4 : n )))

# Older megatron-core releases the integration is checked against (make test-compat; CI runs it too).
COMPAT_MCORE ?= 0.17.1 0.18.2
COMPAT_DIR := .compat
COMPAT_TESTS := tests/unit/test_megatron_integration.py tests/unit/test_no_host_sync.py tests/unit/test_ep_overlap.py \
  tests/cli/test_run_entry_point.py tests/cli/test_demo.py
# A Megatron-LM source tree whose megatron-core ships its own deepepv2 (e.g. its dev branch), for make test-native.
MEGATRON_LM ?=

.PHONY: venv demo test test-compat test-native test-megatron clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.12 (pyenv: 'pyenv install 3.12')" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip $(PIP_ARGS)
	$(PY) -m pip install --quiet --no-cache-dir $(PIP_ARGS) -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m megatron_deepepv2.cli.demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) tools/check_kernel_determinism_coverage.py --all --base-ref auto --labels $(DETERMINISM_LABELS)
	$(PY) -m pytest -n $(TEST_WORKERS) -q $(PYTEST_ARGS)

# Each older release goes into its own small folder (megatron-core only, no dependencies) that PYTHONPATH puts before
# .venv's site-packages, so the compat runs share .venv's torch instead of installing a multi-GB copy per release.
test-compat: $(STAMP)
	@for v in $(COMPAT_MCORE); do \
	  dir=$(COMPAT_DIR)/megatron-core-$$v; \
	  if [ ! -f $$dir/.installed ]; then \
	    rm -rf $$dir && $(PY) -m pip install --quiet --no-cache-dir --no-deps --target $$dir "megatron-core==$$v" pyyaml \
	      && touch $$dir/.installed || exit 1; \
	  fi; \
	  echo "== megatron-core $$v"; \
	  PYTHONPATH=$(CURDIR)/$$dir $(PY) -c "import importlib.metadata as m, megatron.core; \
	    assert m.version('megatron-core') == '$$v', m.version('megatron-core')" || exit 1; \
	  PYTHONPATH=$(CURDIR)/$$dir $(PY) -m pytest -n $(TEST_WORKERS) -q $(COMPAT_TESTS) || exit 1; \
	done

# Coexistence with a native deepepv2: the manager-choice tests, then the Megatron-facing tests, against MEGATRON_LM's tree.
test-native: $(STAMP)
	@test -n "$(MEGATRON_LM)" || { echo "usage: make test-native MEGATRON_LM=/path/to/Megatron-LM" >&2; exit 2; }
	MEGATRON_DEEPEPV2_NATIVE_TREE=$(abspath $(MEGATRON_LM)) $(PY) -m pytest -n $(TEST_WORKERS) -q -rs tests/unit/test_native_megatron.py
	PYTHONPATH=$(abspath $(MEGATRON_LM)) $(PY) -m pytest -n $(TEST_WORKERS) -q $(COMPAT_TESTS)

# Megatron-Core's own flex-dispatcher tests from MEGATRON_LM's tree, run against deepepv2 on each backend, with and
# without host sync (tools/megatron_conformance.py; CONFORMANCE_ARGS: e.g. --backends reference).
CONFORMANCE_ARGS ?=
test-megatron: $(STAMP)
	@test -n "$(MEGATRON_LM)" || { echo "usage: make test-megatron MEGATRON_LM=/path/to/Megatron-LM" >&2; exit 2; }
	$(PY) tools/megatron_conformance.py --megatron-lm $(abspath $(MEGATRON_LM)) $(CONFORMANCE_ARGS)

clean:
	rm -rf .venv $(COMPAT_DIR) build *.egg-info  # never an environment given as VENV=
