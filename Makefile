# make demo | make test | make bench | make report | make format
# Both demo and test create .venv if needed and install the package into it
# (editable). MPTP_SKIP_CUDA_BUILD=1 installs without the CUDA extension, as
# does a machine without nvcc, cmake or a CUDA build of torch; both commands
# then run the reference path and say so once.
PYTHON ?= python3
VENV ?= .venv
VPY := $(abspath $(VENV))/bin/python
# The torch of record on the CPU machines; override e.g. TORCH_SPEC="torch>=2.11".
TORCH_SPEC ?= torch==2.14.1
PYTEST_ARGS ?=
# NOTE: the stamp names the build mode and this tree, so switching MPTP_SKIP_CUDA_BUILD (or
# pointing VENV at a venv another checkout installed into) reinstalls.
BUILD_MODE := $(if $(filter 1 true yes on,$(MPTP_SKIP_CUDA_BUILD)),python-only,auto)
TREE := $(shell printf '%s' "$(CURDIR)" | cksum | cut -d' ' -f1)
STAMP := $(abspath $(VENV))/.mptp-installed-$(BUILD_MODE)-$(TREE)
SOURCES := setup.py pyproject.toml CMakeLists.txt $(shell find csrc -type f 2>/dev/null)
STATUS := $(VPY) scripts/build_status.py

.PHONY: install demo test bench report format clean

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(VPY) $(SOURCES)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel
	$(VPY) -m pip install -q "$(TORCH_SPEC)" numpy pytest
	rm -f $(abspath $(VENV))/.mptp-installed-*
	$(VPY) -m pip install -q --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)
	@$(STATUS)

demo: $(STAMP)
	$(VPY) examples/demo.py

test: $(STAMP)
	@$(STATUS)
	cd tests && $(VPY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(VPY) bench/bench_persistent_matmul.py

# README performance tables + bench/results/*.png from the CSVs (plots need matplotlib in the venv).
report:
	$(if $(wildcard $(VPY)),$(VPY),$(PYTHON)) bench/report.py --readme README.md

format:
	$(VPY) -m ruff format mptp_kernels tests bench examples scripts setup.py && $(VPY) -m ruff check --fix mptp_kernels tests bench examples scripts setup.py
	clang-format -i $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h')

clean:
	rm -rf $(VENV) build *.egg-info mptp_kernels/_C*.so mptp_kernels/_build_info.py
