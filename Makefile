# Two targets do all set-up on a fresh machine; each makes its own virtual environment.
#   make demo   train the embedded default (3D U-Net on synthetic MRI-like volumes) under a memory budget
#   make test   run the test suite
# TORCH pins the PyTorch requirement installed first; a GPU machine gets the CUDA build from PyPI. A TORCH
# other than the one last installed into $(VENV) is installed on the next make demo/test. The extras are
# installed with $(TORCH) on the same command line: where one of their dependencies wants another torch
# (the newest MONAI or transformers beside an older TORCH), pip picks a version that fits $(TORCH) instead
# of replacing it.
#   make gpu    on a CUDA machine: every CUDA test and benchmark in 9 minutes, JSON and a summary under
#               bench/results/gpu/<date>-<device>/ (bench/gpu_suite.py). Installs nothing: runs from the source
#               tree with $(PYTHON) and the PyTorch it has. GPU_SUITE_ARGS="--dry-run" checks it on CPU.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV ?= .venv
TORCH_STAMP = $(VENV)/.torch-requirement

# The TORCH last asked for, rewritten only when it changes: then it is newer than .installed, which
# reinstalls (otherwise `make demo TORCH=...` would be ignored once $(VENV) exists).
$(TORCH_STAMP): FORCE
	@mkdir -p $(VENV)
	@if [ "$$(cat $@ 2>/dev/null)" != '$(TORCH)' ]; then echo '$(TORCH)' > $@; fi

$(VENV)/.installed: pyproject.toml $(TORCH_STAMP)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q "$(TORCH)"
	$(VENV)/bin/pip install -q -e ".[test]" "$(TORCH)"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/oomless train --size 64 --global-batch 2 --memory 256MiB --steps 20 --seed 0 --save runs/demo.safetensors

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q

# Planted bugs (dev/planted_bugs.py): each in a copy of src/, the tests that should notice run against it.
mutants: $(VENV)/.installed
	$(VENV)/bin/python dev/planted_bugs.py

# Generated mutants (dev/generated_mutants.py): a seeded, stratified sample of 100 one-token edits of runtime/,
# the planner and parallel/, each run against its module's tests; results in bench/results/generated-mutants.json.
# About 2 hours on two shared cores. MUTANTS_ARGS="--resume" continues a run that was cut short;
# "--only plan/solvers.py" runs one module's share; "--list" prints the sample.
mutants-generated: $(VENV)/.installed
	$(VENV)/bin/python dev/generated_mutants.py $(MUTANTS_ARGS)

gpu:
	PYTHONPATH=src $(PYTHON) bench/gpu_suite.py $(GPU_SUITE_ARGS)

FORCE:

.PHONY: demo test gpu mutants mutants-generated FORCE
