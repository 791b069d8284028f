# The two commands a newcomer runs (README): `make demo` and `make test`.
# Both work from a clean clone as root on Debian 12: they install the system packages
# they need and create their own virtualenv (.venv).

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# bench: kvtool with its runtime dependencies only, installed as `pip install kvtool` installs
# it (not editable: an editable install's import hook loads pathlib, re and more into every
# Python process, the reference's too). The bench scripts run this tree's kvtool ahead of
# the installed copy (PYTHONPATH). The test and plot extras in .venv add modules that change
# the CLI's start-up.
BENCH_VENV ?= .venv-bench
# fio: reference for bench/; qemu-system-x86: the real Linux NVMe/TCP target and host in a
# guest; util-linux: losetup; libibverbs1: Mooncake Store's transfer engine (extra); iproute2:
# `rdma link add` (soft-RoCE) in the QEMU guest, through its view of the host root.
SYS_PKGS = python3-venv python3-dev gcc fio qemu-system-x86 util-linux e2fsprogs cpio \
           busybox-static libibverbs1 iproute2

.PHONY: demo test sysdeps venv compiled lint type bench clean

sysdeps:
	@missing=$$(for p in $(SYS_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "apt-get install: $$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,plot]' tox
	touch $@

venv: $(VENV)/.stamp

$(BENCH_VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q .
	touch $@

## The serving model's hot modules compiled with mypyc (kvtool.compiled; mypy comes with the
## test extra) into /var/tmp/kvtool-compiled, keyed by their sources: kvtool imports them
## while they match the sources, else the pure modules (KVTOOL_COMPILED=0: always pure).
compiled: venv
	$(PY) -m kvtool.compiled build

## The main job on the embedded default (the emulator): see README "Quick start".
demo: sysdeps venv
	PATH=$(abspath $(VENV))/bin:$$PATH bash fixtures/demo.sh

## The test suite, lint and type check, exactly as CI runs them (.ci/run).
test: sysdeps venv
	$(VENV)/bin/tox run

## The replay speed and memory benchmarks (BENCHMARKS.md) in $(BENCH_VENV). They print
## ratios against references measured in the same run; nothing here asserts on time.
## nvme_target_perf: the emulator's NVMe/TCP target against SPDK's (SPDK built once; needs
## the spdk extra, so it runs in $(VENV)). connector_speed: the vLLM connector against vLLM's
## own (the engine virtualenv, kvtool/integrations/venv.py, built once under /var/tmp).
## serving_speed: with the compiled modules (make compiled), as a user who ran it has them.
bench: $(BENCH_VENV)/.stamp venv compiled
	PYTHONPATH=$(CURDIR) $(BENCH_VENV)/bin/python bench/replay_speed.py --repeat 21
	PYTHONPATH=$(CURDIR) $(BENCH_VENV)/bin/python bench/replay_speed.py --repeat 5 --times 10
	PYTHONPATH=$(CURDIR) $(BENCH_VENV)/bin/python bench/replay_memory.py
	PYTHONPATH=$(CURDIR) $(BENCH_VENV)/bin/python bench/serving_speed.py --repeat 5
	$(PY) bench/nvme_target_perf.py --rounds 3 --write --priority -10
	PYTHONPATH=$(CURDIR) $$($(PY) -m kvtool.integrations.venv) bench/connector_speed.py --repeat 3

lint: venv
	$(VENV)/bin/tox run -e lint

type: venv
	$(VENV)/bin/tox run -e type

clean:
	rm -rf $(VENV) $(BENCH_VENV) .tox build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
