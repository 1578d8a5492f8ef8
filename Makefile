# Two commands on a fresh machine:  make demo   and   make test
VENV ?= $(HOME)/.cache/dspark-harden/venv
export DSPARK_VENV := $(VENV)
PYTHON := $(VENV)/bin/python
PYTEST_ARGS ?=
# pytest-xdist: three workers on the 2-core CI machine (measured faster than two, quiet and beside a busy
# neighbour); every module that starts a SGLang server runs in one group on one worker, the other modules one
# unit each, in the collection order (docs/testing.md)
XDIST_ARGS ?= -n 3 --dist loadgroup --no-loadscope-reorder

.PHONY: install demo test check test-fast lint gpu-test clean wheel

install:
	bash scripts/install.sh

## main job: self-check, then a real DP2 SGLang server on CPU with the plugin active
demo: install
	$(PYTHON) scripts/demo.py

## the whole test suite (starts every process it needs: SGLang servers, Prometheus)
test: install
	$(PYTHON) -m pytest -ra -p no:cacheprovider --timeout=1800 --durations=30 $(XDIST_ARGS) tests $(PYTEST_ARGS)

## quick: no real server
test-fast: install
	$(PYTHON) -m pytest -ra -m "not server" $(XDIST_ARGS) tests $(PYTEST_ARGS)

## the linters alone (ruff check + format, clang-format, gcc warnings + analyzer; make test runs them too)
lint: install
	$(PYTHON) -m pytest -q -p no:cacheprovider tests/packaging/test_lint.py

check: install
	SGLANG_PLUGINS=dspark_harden $(VENV)/bin/dspark-harden check

## the sdist and the cp310-abi3 wheel in dist/ (offline, with the virtualenv's build tools; docs/install.md)
wheel: install
	$(PYTHON) -m build --no-isolation --outdir dist .

clean:
	rm -rf build src/*.egg-info src/dspark_harden/_dp2_native*.so src/dspark_harden/_dp2_native.c src/dspark_harden/_traverse_native*.so src/dspark_harden/_traverse_native.c .pytest_cache
