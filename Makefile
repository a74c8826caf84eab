# The two commands of the README: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test test-all lint setup clean chromium

$(BIN)/graphpar: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/graphpar

# Compile the bundled example GPT (125M shape) for a 2x4 DGX-A100 mesh and print the report.
run: setup
	$(BIN)/graphpar compile --example gpt:125M --mesh 2x4 --out graphpar-out

# The viz browser test renders in Debian's headless chromium: install it when missing and we can.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
	  || echo "make: chromium is not installed; the viz browser test will skip"

# The fast default suite (slow-marked tests excluded; GPU tests skip without a GPU).
test: setup chromium
	$(BIN)/python -m pytest

test-all: setup chromium
	$(BIN)/python -m pytest -m ''

lint: setup
	$(BIN)/ruff check graphpar tests tools

clean:
	rm -rf $(VENV) graphpar-out .pytest_cache
