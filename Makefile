# Two commands matter: `make demo` and `make test`. Both set up .venv first (torch's local CPU build, then
# graphddp and its test extras pinned by constraints.txt); nothing here can pull a CUDA build of torch.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test test-quick test-slow setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "torch==2.13.0"
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test]"
	touch $@

demo: setup
	$(BIN)/graphddp demo

# The default suite (under 10 minutes on 2 cores), then the tests marked slow: CI runs both.
test: test-quick test-slow

test-quick: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-slow: setup
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && echo "no slow tests" || exit $$rc

clean:
	rm -rf $(VENV) *.egg-info
