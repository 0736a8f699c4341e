# make demo | make test | make bench | make format
# Both demo and test create .venv if needed and install the package into it.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# The torch of record on the CPU machines; override e.g. TORCH_SPEC="torch>=2.11".
TORCH_SPEC ?= torch==2.14.1
STAMP := $(VENV)/.mptp-installed
SOURCES := setup.py pyproject.toml CMakeLists.txt $(shell find csrc -type f 2>/dev/null)

.PHONY: install demo test test-gpu bench format clean

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(VPY) $(SOURCES)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel
	$(VPY) -m pip install -q "$(TORCH_SPEC)" numpy pytest
	$(VPY) -m pip install -q --no-build-isolation -e .
	$(VPY) -c "import mptp_kernels as m; print('mptp_kernels installed; CUDA extension built:', m.build_info.CUDA_EXTENSION_BUILT)"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VPY) examples/demo.py

test: $(STAMP)
	cd tests && ../$(VPY) -m pytest -q

bench: $(STAMP)
	$(VPY) bench/bench_persistent_matmul.py

format:
	$(VPY) -m ruff format mptp_kernels tests bench examples && $(VPY) -m ruff check --fix mptp_kernels tests bench examples
	clang-format -i $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h')

clean:
	rm -rf $(VENV) build *.egg-info mptp_kernels/_C*.so mptp_kernels/_build_info.py
