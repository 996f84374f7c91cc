# Two commands for a fresh machine: `make demo` and `make test` (each installs what it needs).
PYTHON ?= python3
export PYTHON

.PHONY: install install-test demo test lint bench gpu-check coverage

install:
	bash scripts/install.sh

install-test:
	bash scripts/install.sh test

demo: install
	$(PYTHON) examples/demo.py

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy
	$(PYTHON) scripts/check_imports.py

# Two worker processes, a test file each at a time (module fixtures start once): 6 to 16 minutes on 2 cores, by the machine.
TEST_WORKERS ?= 2
test: install-test lint
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Line coverage of ditorch/ and op_tools/ over the whole suite, the Python children tests start included (coverage's
# patch = subprocess, pyproject.toml: so they start as new interpreters, not forked by tests/forked_python.py);
# about 15 minutes on 2 cores. The figure is recorded in docs/performance.md.
coverage:
	bash scripts/install.sh test,coverage
	TESTS_FORKED_PYTHON=0 COVERAGE_FILE=$(CURDIR)/.coverage $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --cov \
		--cov-report=term-missing:skip-covered

# Every benchmark, one after another (figures recorded in docs/performance.md); about 15 minutes on 2 cores.
bench: install-test
	$(PYTHON) benchmarks/sim_overhead.py
	$(PYTHON) benchmarks/import_overhead.py
	$(PYTHON) benchmarks/autocompare_cost.py --reference cpu,device
	$(PYTHON) benchmarks/time_measure_cost.py
	$(PYTHON) benchmarks/overhead.py
	$(PYTHON) benchmarks/capture_storage.py
	$(PYTHON) benchmarks/conformance_sweep.py
	$(PYTHON) benchmarks/collective_checks_cost.py
	$(PYTHON) benchmarks/training_monitor_cost.py
	$(PYTHON) benchmarks/stay_on_cost.py
	# the host's work per call, where the CPU's kernels take microseconds as a GPU's launches do (docs/performance.md)
	$(PYTHON) benchmarks/stay_on_cost.py --device cpu --size tiny --steps 5 --tools OpCapture
	$(PYTHON) benchmarks/engine_cost.py

# On a machine with a CUDA GPU: the gpu-marked tests and the GPU benchmarks, one summary table at the end.
# Installs nothing (a missing dependency is named); without a GPU it says so and exits 0.
gpu-check:
	bash scripts/gpu_check.sh
