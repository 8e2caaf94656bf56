# KREX developer tasks. `make help` lists them.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.DEFAULT_GOAL := help

help: ## Show this help
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-10s\033[0m %s\n", $$1, $$2}'

install: ## Create .venv, install KREX editable with dev extras, build shim + simulated GPU
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	$(PY) -c "import krex.native as n; n.shim_path(); n.sim_dir(); print('krex installed:', n.LIB_DIR)"

native: ## Rebuild only the C artifacts into krex/_lib (after editing interpose/)
	$(PY) krex_build.py krex/_lib
	$(PY) krex_build.py --cffi
	@# the installed `krex` is a copy of the native guardian (setup.py's build_scripts)
	@if [ -x krex/_lib/krex ] && [ -d $(VENV)/bin ]; then install -m 755 krex/_lib/krex $(VENV)/bin/krex; fi

test: ## Run the whole test suite (unit + integration; gpu tests skip without a GPU)
	$(PY) -m pytest -q tests

sanitize: ## The shim and the C tests built with ThreadSanitizer and AddressSanitizer, run against krexd (simulated GPU)
	$(PY) scripts/sanitize.py

lint: ## ruff + mypy + the code's shape (module, class, function sizes) + news fragments
	$(VENV)/bin/ruff check krex cli tests scripts benchmarks krex_build.py setup.py
	$(VENV)/bin/mypy krex cli
	$(PY) scripts/internal/check_shape.py
	$(PY) scripts/internal/changelog.py --check

bench: ## Gate fast-path cost, then krex bench --quick (simulated GPU without a GPU; real numbers need one)
	$(PY) scripts/fastpath/run.py 5
	$(VENV)/bin/krex bench --quick

wheel-check: ## Build sdist + manylinux wheel, install it in a fresh venv, smoke-test it from elsewhere (as CI does)
	bash scripts/wheel_check.sh

clean: ## Remove build outputs
	rm -rf build dist *.egg-info krex/_lib krex/_native*.so

.PHONY: help install native test sanitize lint bench wheel-check clean
