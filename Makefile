# Set-up commands: `make test` and `make demo` bootstrap .venv by themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Reinstall only when pyproject.toml changed since the last install.
STAMP := $(VENV)/.installed
CONTRACT_CHECK := ../shared/tools/check_contract.py

.PHONY: test install

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	@if [ -f $(CONTRACT_CHECK) ]; then $(PY) $(CONTRACT_CHECK); fi
	$(PY) -m pytest
