# The README's two commands: `make demo` (main job) and `make test` (test suite).
# Both create .venv with Python 3.12 when it is missing and install the package into it.

PYTHON ?= python3.12
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: venv demo test gate clean

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

clean:
	rm -rf $(VENV) build *.egg-info
