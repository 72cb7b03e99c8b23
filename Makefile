# Set-up commands: `make test` and `make demo` bootstrap .venv by themselves
# (`make install` only bootstraps it). The contract check is tests/core/test_contract.py.
# The interpreter .venv is made from (`make PYTHON=...` picks another): the system's own
# /usr/bin/python3 where it is 3.10 or newer and can make a venv, else the python3 on the
# path. Distributions build theirs with profile-guided and link-time optimization, which a
# Python built from source by default (pyenv's) lacks; every Ray worker, the simulation
# and pytest run on it (docs/DESIGN.md, "Tests on one machine").
PYTHON ?= $(shell /usr/bin/python3 -c 'import sys, ensurepip, venv; \
	sys.exit(sys.version_info < (3, 10))' 2>/dev/null && echo /usr/bin/python3 || echo python3)
# PIPESTATUS: pip's own exit status through the filter below.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# Reinstall only when pyproject.toml changed since the last install.
STAMP := $(VENV)/.installed
# NeMo Gym, installed beside it (below) for the tests against the real package.
NEMO_GYM_VERSION := 0.7.0
GYM_STAMP := $(VENV)/.nemo-gym-$(NEMO_GYM_VERSION)
# Extra options for the demo, e.g. `make demo DEMO_ARGS='--nodes 4 --json demo.json'`.
DEMO_ARGS ?=

# Every process the tests and demos start (each Ray actor is a new Python process, hundreds
# per `make test`) imports nemo_ckpt from source: with PYTHONDONTWRITEBYTECODE set, as on
# machines that set it for everyone, each would compile every module of ours again as it
# starts (benchmarks/README.md, "Actor start-up"). So the recipes below run with it
# unset, and `make test` compiles the sources once up front.
unexport PYTHONDONTWRITEBYTECODE
COMPILE := $(PY) -m compileall -q nemo_ckpt actors tests examples benchmarks

# The deterministic simulation's schedules per `make test` (tests/simulation/): 5,200,
# about 3 to 4 minutes here, to keep `make test` under 20 minutes on 2 cores with the
# container tests; seeds 0 to 5,199, so every seed that found a defect below that is
# replayed (the highest, 5,193: docs/FAILURES.md). `python -m tests.simulation` alone
# runs 10,000. A violation prints its seed and the command that replays it.
SIM_SCHEDULES ?= 5200

.PHONY: test install demo demo-s3 demo-containers demo-gym demo-preemption container-runtime

install: $(STAMP) $(GYM_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# uv installs the project and its test tools: the same resolution pip makes (the same
# versions), with its downloads in parallel, in about a quarter of pip's time on a fresh
# venv here (pip spent a minute or more mostly waiting on one download at a time). It
# compiles the bytecode as pip does, so that no process of the tests compiles Ray's
# modules again. uv itself comes from the package index through the venv's pip, pinned.
# npm runs beside it, and each one's failure fails the install.
UV_VERSION := 0.13.10
UV := $(VENV)/bin/uv
# uv's wait for a slow registry, as long as the one pip is given here (PIP_DEFAULT_TIMEOUT).
export UV_HTTP_TIMEOUT ?= 180
$(UV): | $(PY)
	@$(PY) -m pip install --progress-bar off -q uv==$(UV_VERSION) 2>&1 \
		| grep -v -e '^WARNING: Location ' -e '^Looking in' ; \
		exit $${PIPESTATUS[0]}

# NeMo Gym 0.7.0 itself, for the tests of nemo_ckpt/integrations/nemo_gym.py: once,
# stamped, without its dependencies. It declares Python >= 3.13.14 and a large set of
# dependencies, but its sandbox code runs on 3.11 with what the venv has, and orjson: so
# its wheel (pure Python) is chosen for the Python it declares (pip's
# --ignore-requires-python), and orjson's for the venv's own.
$(GYM_STAMP): | $(UV)
	@echo "make install: installing nemo-gym $(NEMO_GYM_VERSION) (without its dependencies) for the NeMo Gym tests"
	@$(UV) pip install --python $(PY) --compile-bytecode --no-deps --python-version 3.13.14 \
		nemo-gym==$(NEMO_GYM_VERSION)
	@$(UV) pip install --python $(PY) --compile-bytecode --no-deps orjson
	@touch $(GYM_STAMP)

# Azurite, the Azure Blob emulator the az:// tests run against, comes from npm.
AZURITE_VERSION := 3.35.0

$(STAMP): pyproject.toml Makefile | $(UV)
	@echo "make install: installing nemo-ckpt and its test tools into $(VENV) (uv; a fresh venv takes about 20 s), and Azurite $(AZURITE_VERSION) (npm) for the az:// tests beside it"
	@npm install --prefix $(VENV)/npm --no-audit --no-fund --silent azurite@$(AZURITE_VERSION) & \
		npm_pid=$$!; \
		$(UV) pip install --python $(PY) --compile-bytecode -e '.[test]'; \
		uv_status=$$?; \
		if ! wait $$npm_pid; then echo "make install: npm could not install Azurite $(AZURITE_VERSION)" >&2; exit 1; fi; \
		exit $$uv_status
	@touch $(STAMP)
	@echo "make install: done; the tools are in $(VENV)/bin"

# pytest on three workers (pytest-xdist) on this 2-core machine: the Ray tests often wait
# (leases, deadlines, a node declared dead), and with two workers a tenth of the cores sat
# idle; the third fills it (a full run here: 915 s against 999 and 1,126 s with two). Each
# worker runs whole modules (tests/conftest.py groups them) on a Ray cluster of its own.
PYTEST_WORKERS ?= 3
test: $(STAMP) $(GYM_STAMP)
	$(VENV)/bin/ruff check nemo_ckpt actors tests examples benchmarks
	$(VENV)/bin/mypy
	$(COMPILE)
	$(PY) -m tests.container_runtime
	$(PY) -m tests.simulation --schedules $(SIM_SCHEDULES)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile

# The local container runtime (tests/container_runtime.py): podman, runc and conmon from
# apt, CRIU 4.x built from Debian's source package where the system's fails `criu check`,
# a project-local containers.conf and a busybox image; once per machine, idempotently
# (seconds when all is there; about a minute the first time).
container-runtime: $(STAMP)
	$(PY) -m tests.container_runtime

# Rollouts whose environment is a container (examples/container_recovery.py): state on
# disk and in a running process's memory, a hard crash, a restore, VERIFIED against a
# crash-free run; on the runtime `make container-runtime` installs.
demo-containers: $(STAMP)
	$(PY) -m tests.container_runtime -- $(PY) examples/container_recovery.py $(DEMO_ARGS)

# NeMo Gym's sandboxes on nemo-ckpt's providers (examples/gym_sandboxes.py): rollouts'
# tools through Gym's AsyncSandbox, the job killed hard, a restore, VERIFIED against a
# crash-free run; both providers' sandboxes in one job (DEMO_ARGS='--provider docker' for
# one), the docker one's on podman (the runtime above).
demo-gym: $(STAMP) $(GYM_STAMP)
	$(PY) -m tests.container_runtime -- $(PY) examples/gym_sandboxes.py $(DEMO_ARGS)

# The end-to-end turn-level recovery run on an embedded local Ray cluster.
demo: $(STAMP)
	$(PY) examples/turn_level_recovery.py $(DEMO_ARGS)

# The same run with its checkpoints in a bucket of a local S3-compatible server
# (SeaweedFS, from the test extra), started for the run and stopped after it.
demo-s3: $(STAMP)
	$(PY) -m tests.s3_server -- \
		$(PY) examples/turn_level_recovery.py --checkpoint-dir s3://ckpt/demo $(DEMO_ARGS)

# The snapshot benchmark (benchmarks/README.md): the full grid, ~4-6 min on 2 cores,
# then the fan-out model (benchmarks/fanout.py, ~3 min; also after --quick).
# Prints its tables and writes bench-results.json. `make bench BENCH_ARGS=--quick` runs
# two grid points and the quick scale series (~2 min); BENCH_ARGS=--scale the scale
# series to a million sessions (~7 min); BENCH_ARGS=--object-store snapshots into a
# local S3-compatible server against the client library's own put and get (~3 min).
# Without BENCH_ARGS or with --quick, then benchmarks.sandboxes_vs_restic (issue 26:
# sandboxes against restic and tar; 1,000 x 1,000 files, ~15 min, or 100 sandboxes with --quick).
BENCH_ARGS ?=
# Then the adapter's benchmark (issue 28; ~1 min): ADAPTER_BENCH_ARGS=--quick for ~15 s.
ADAPTER_BENCH_ARGS ?=
.PHONY: bench
bench: $(STAMP) restic
	$(PY) -m benchmarks.snapshot_bench $(BENCH_ARGS) --json bench-results.json
	$(PY) -m benchmarks.adapter $(ADAPTER_BENCH_ARGS)
	$(if $(filter-out --quick,$(BENCH_ARGS)),,$(PY) -m benchmarks.sandboxes_vs_restic $(BENCH_ARGS))

# restic, for benchmarks/sandboxes_vs_restic.py: Debian's package unpacked into
# $(VENV)/restic, the system left as it is (apt-get update only when the package lists
# are empty). If it cannot be had, the benchmark says so and runs without it.
RESTIC := $(VENV)/restic/usr/bin/restic
.PHONY: restic
restic: $(RESTIC)

$(RESTIC): | $(PY)
	@echo "make restic: unpacking Debian's restic into $(VENV)/restic (apt-get download, dpkg -x)"
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
		if ! apt-cache show restic >/dev/null 2>&1; then \
			echo "make restic: apt-get update (no package lists)"; apt-get update -qq || true; fi; \
		( cd "$$tmp" && apt-get download -qq restic ) \
			&& dpkg -x "$$tmp"/restic_*.deb $(VENV)/restic \
			&& echo "make restic: $$($(RESTIC) version)" \
		|| echo "make restic: restic could not be had; the benchmark runs without it"

# A job told to stop (examples/preemption_recovery.py): a child job sent SIGTERM mid-run
# takes a final snapshot within its deadline and exits 143; a fresh job restores every
# committed turn, VERIFIED against a crash-free run. `DEMO_ARGS=--drain` drains a
# holder's node with Ray's `ray drain-node` instead.
demo-preemption: $(STAMP)
	$(PY) examples/preemption_recovery.py $(DEMO_ARGS)
