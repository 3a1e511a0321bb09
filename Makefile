# redis-locks-async — developer entry points. A fresh machine needs only Python >= 3.10 and make:
# every target that needs the virtualenv creates it (.venv) first.
#
#   make test       ruff + mypy --strict + pytest once per server binary (bundled Valkey, system Redis),
#                   plus fast subsets on Python 3.10/3.12/3.13 and with the minimum dependency versions
#   make demo       python -m redis_locks_async demo (embedded server unless REDIS_URL is set)
#   make bench      python -m benchmarks
#   make soak       the S6 stateful harness at length (SOAK_EXAMPLES x SOAK_STEPS per primitive)
#   make lint / typecheck / clean / distclean

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PYTEST_ARGS ?=

# One stamp per extra: each is redone when pyproject.toml changes, and is a no-op otherwise.
STAMP_DEV := $(VENV)/.stamp-dev
STAMP_DEMO := $(VENV)/.stamp-demo
STAMP_BENCH := $(VENV)/.stamp-bench

.DEFAULT_GOAL := test
.PHONY: venv test prepare-subsets pytest pytest-pythons pytest-minimum bench-smoke lint typecheck demo bench soak clean distclean

venv: $(STAMP_DEV)

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(STAMP_DEV): pyproject.toml | $(VPY)
	$(VPY) -m pip install --quiet -e '.[dev]'
	@touch $@

$(STAMP_DEMO): pyproject.toml | $(VPY)
	$(VPY) -m pip install --quiet -e '.[demo]'
	@touch $@

$(STAMP_BENCH): pyproject.toml | $(VPY)
	$(VPY) -m pip install --quiet -e '.[bench]'
	@touch $@

lint: venv
	$(VPY) -m ruff check .

typecheck: venv
	$(VPY) -m mypy --strict

# pytest once per server binary: `python -m tests.servers --list` prints the bundled Valkey, then
# the system redis-server if on PATH (or only $$REDIS_SERVER_BIN if set). Tests marked `once`
# (the wheel, the demo, the examples: what they check does not depend on the server) run in the
# first pass only. The passes run side by side (PYTEST_SERIAL=1: one after the other): the suite
# mostly waits — for leases, claim windows, timeouts — so two passes take about the time of one
# on 2 cores. Each pass writes to its own log, printed whole when all are done; every pass runs
# even if another failed, and the target fails if any did.
PYTEST_SERIAL ?=
pytest: venv
	@binaries="$$($(VPY) -m tests.servers --list)" || exit 1; \
	logs="$$(mktemp -d)"; marker=""; n=0; \
	run() { \
		REDIS_SERVER_BIN="$$1" $(VPY) -m pytest --durations=15 $${2:+-m "$$2"} $(PYTEST_ARGS) \
			>> "$$3.log" 2>&1; echo $$? > "$$3.status"; \
	}; \
	for bin in $$binaries; do \
		n=$$((n + 1)); \
		title="pytest against $$($$bin --version)$${marker:+ (tests marked 'once' run in the first pass only)}"; \
		echo "=== started: $$title"; \
		{ echo ""; echo "=== $$title"; echo "=== REDIS_SERVER_BIN=$$bin"; } > "$$logs/$$n.log"; \
		if [ -n "$(PYTEST_SERIAL)" ]; then run "$$bin" "$$marker" "$$logs/$$n"; \
		else run "$$bin" "$$marker" "$$logs/$$n" & fi; \
		marker="not once"; \
	done; \
	wait; \
	status=0; \
	for i in $$(seq 1 $$n); do \
		cat "$$logs/$$i.log"; \
		[ "$$(cat "$$logs/$$i.status" 2>/dev/null)" = 0 ] || status=1; \
	done; \
	rm -rf "$$logs"; \
	if [ $$status -ne 0 ]; then echo "=== pytest FAILED on at least one server"; fi; \
	exit $$status

# The fast subset on the oldest and newest supported Pythons (SPEC §7), against the bundled
# Valkey, each in its own .venv-X.Y with only the `test` extra. A version that is not installed
# (neither pythonX.Y on PATH nor under pyenv) is skipped with a note.
PY_SUBSET ?= 3.10 3.12 3.13
FAST_TESTS ?= tests/test_lock.py tests/test_keys.py tests/test_asyncio_only.py tests/test_lane.py
pytest-pythons:
	@status=0; \
	for v in $(PY_SUBSET); do \
		py=""; \
		for cand in "$$(command -v python$$v 2>/dev/null)" $$(ls -d "$${PYENV_ROOT:-$$HOME/.pyenv}"/versions/$$v*/bin/python$$v 2>/dev/null); do \
			if [ -n "$$cand" ] && "$$cand" -c pass 2>/dev/null; then py="$$cand"; break; fi; \
		done; \
		if [ -z "$$py" ]; then echo "=== Python $$v not found: fast subset skipped"; continue; fi; \
		venv=".venv-$$v"; \
		if [ ! -f "$$venv/.stamp" ] || [ pyproject.toml -nt "$$venv/.stamp" ]; then \
			"$$py" -m venv "$$venv" && "$$venv/bin/python" -m pip install --quiet -e '.[test]' \
				&& touch "$$venv/.stamp" || { status=1; continue; }; \
		fi; \
		if [ -n "$(PREPARE_ONLY)" ]; then continue; fi; \
		bin="$$("$$venv/bin/python" -m tests.servers --list | sed -n 1p)"; \
		echo ""; echo "=== fast subset on $$("$$venv/bin/python" --version) against $$bin"; \
		REDIS_SERVER_BIN="$$bin" "$$venv/bin/python" -m pytest -q $(FAST_TESTS) || status=1; \
	done; \
	exit $$status

# The fast subset with the lowest dependency versions pyproject.toml allows, in .venv-min on the
# oldest supported Python (python3.10 on PATH or under pyenv, else $(PYTHON)), against the bundled
# Valkey. The redis and anyio floors are read from pyproject.toml's `>=` pins, so the floor that
# is declared is the floor that is tested; hiredis is pinned to the lowest that redis's [hiredis]
# extra accepts. Besides FAST_TESTS it runs the cancellation tests, the only ones that use anyio
# (cancel scopes). Redone when pyproject.toml or the pins change; skipped with a note if no venv
# can be created.
MIN_VENV := .venv-min
MIN_PY ?= 3.10
MIN_REDIS := $(shell sed -n 's/^ *"redis\[hiredis\]>=\([0-9][0-9.]*\)",.*/\1/p' pyproject.toml)
MIN_ANYIO := $(shell sed -n 's/^ *"anyio>=\([0-9][0-9.]*\)",.*/\1/p' pyproject.toml)
MIN_HIREDIS ?= 3.2.0
MIN_TESTS ?= $(FAST_TESTS) tests/test_lock_faults.py::TestCancellation
pytest-minimum:
	@if [ -z "$(MIN_REDIS)" ] || [ -z "$(MIN_ANYIO)" ]; then \
		echo "=== cannot read the redis/anyio floors from pyproject.toml"; exit 1; \
	fi; \
	py=""; \
	for cand in "$$(command -v python$(MIN_PY) 2>/dev/null)" $$(ls -d "$${PYENV_ROOT:-$$HOME/.pyenv}"/versions/$(MIN_PY)*/bin/python$(MIN_PY) 2>/dev/null) "$$(command -v $(PYTHON) 2>/dev/null)"; do \
		if [ -n "$$cand" ] && "$$cand" -c pass 2>/dev/null; then py="$$cand"; break; fi; \
	done; \
	pins="redis[hiredis]==$(MIN_REDIS) hiredis==$(MIN_HIREDIS) anyio==$(MIN_ANYIO)"; \
	stamp="$(MIN_VENV)/.stamp"; \
	if [ ! -f "$$stamp" ] || [ pyproject.toml -nt "$$stamp" ] || [ "$$(cat "$$stamp")" != "$$pins" ]; then \
		if [ -z "$$py" ] || ! "$$py" -m venv $(MIN_VENV); then \
			echo "=== cannot create $(MIN_VENV): minimum-versions subset skipped"; exit 0; \
		fi; \
		$(MIN_VENV)/bin/python -m pip install --quiet -e '.[test]' $$pins || exit 1; \
		echo "$$pins" > "$$stamp"; \
	fi; \
	if [ -n "$(PREPARE_ONLY)" ]; then exit 0; fi; \
	bin="$$($(MIN_VENV)/bin/python -m tests.servers --list | sed -n 1p)"; \
	echo ""; \
	echo "=== fast subset with the minimum versions ($$($(MIN_VENV)/bin/python -c 'from importlib.metadata import version as v; print(", ".join(f"{p} {v(p)}" for p in ("redis", "hiredis", "anyio")))')) on $$($(MIN_VENV)/bin/python --version) against $$bin"; \
	REDIS_SERVER_BIN="$$bin" $(MIN_VENV)/bin/python -m pytest -q $(MIN_TESTS)

# Benchmarks are programs: a quick run (< 1 min) keeps them from rotting (STYLE §12).
bench-smoke: venv
	$(VPY) -m benchmarks --quick --out "$$(mktemp -d)"

# The checks and the making of the subsets' virtualenvs (pip, mostly waiting) run side by side;
# then the fast subsets, one after the other, then the passes over each server (side by side).
prepare-subsets:
	@$(MAKE) --no-print-directory pytest-pythons pytest-minimum PREPARE_ONLY=1

test:
	@$(MAKE) --no-print-directory -j4 --output-sync=target lint typecheck bench-smoke prepare-subsets
	@$(MAKE) --no-print-directory pytest-pythons pytest-minimum pytest

demo: $(STAMP_DEMO)
	$(VPY) -m redis_locks_async demo

bench: $(STAMP_BENCH)
	$(VPY) -m benchmarks

# The S6 stateful harness (tests/test_stateful.py) at length, random seeds, against the first server
# binary: SOAK_EXAMPLES examples of SOAK_STEPS steps per primitive (4 primitives; hours at the
# defaults — e.g. `make soak SOAK_EXAMPLES=50 SOAK_STEPS=40` for ~10 min). Each primitive prints a
# summary line: examples, steps, rules fired, faults injected, elapsed.
SOAK_EXAMPLES ?= 500
SOAK_STEPS ?= 60
soak: venv
	@bin="$$($(VPY) -m tests.servers --list | sed -n 1p)"; \
	echo "=== S6 soak: $(SOAK_EXAMPLES) examples x $(SOAK_STEPS) steps per primitive, $$($$bin --version)"; \
	start=$$(date +%s); \
	STATEFUL_EXAMPLES=$(SOAK_EXAMPLES) STATEFUL_STEPS=$(SOAK_STEPS) REDIS_SERVER_BIN="$$bin" \
		$(VPY) -m pytest tests/test_stateful.py -q -s -p no:cacheprovider $(PYTEST_ARGS); \
	status=$$?; \
	echo "=== S6 soak: $$(( $$(date +%s) - start )) s in all, exit status $$status"; \
	exit $$status

clean:
	rm -rf build dist .mypy_cache .ruff_cache .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) .venv-*
