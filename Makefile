# The README's two commands: `make demo` (main job) and `make test` (test suite).
# Both create .venv with Python 3.12 when it is missing and install the package into it.

PYTHON ?= python3.12
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_ARGS ?=
PYTEST_ARGS ?=

# Older megatron-core releases the integration is checked against (make test-compat; CI runs it too).
COMPAT_MCORE ?= 0.17.1 0.18.2
COMPAT_TESTS := tests/unit/test_megatron_integration.py tests/unit/test_no_host_sync.py tests/unit/test_run_entry_point.py tests/unit/test_demo.py tests/determinism

.PHONY: venv demo test test-compat clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.12 (pyenv: 'pyenv install 3.12')" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m megatron_deepepv2.demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) tools/check_kernel_determinism_coverage.py --all
	$(PY) -m pytest -n auto -q $(PYTEST_ARGS)

test-compat:
	@for v in $(COMPAT_MCORE); do \
	  env=.venv-mcore-$$v; \
	  test -x $$env/bin/python || $(PYTHON) -m venv $$env || exit 1; \
	  $$env/bin/python -m pip install --quiet -e '.[test]' "megatron-core==$$v" pyyaml || exit 1; \
	  echo "== megatron-core $$v"; \
	  $$env/bin/python -m pytest -n auto -q $(COMPAT_TESTS) || exit 1; \
	done

clean:
	rm -rf $(VENV) .venv-mcore-* build *.egg-info
