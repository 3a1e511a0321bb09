# redis-locks-async — developer entry points. A fresh machine needs only Python >= 3.10 and make:
# every target that needs the virtualenv creates it (.venv) first.
#
#   make test       ruff + mypy --strict + pytest once per server binary (bundled Valkey, system Redis)
#   make demo       python -m redis_locks_async demo (embedded server unless REDIS_URL is set)
#   make bench      python -m benchmarks
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
.PHONY: venv test pytest pytest-pythons bench-smoke lint typecheck demo bench clean distclean

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
# the system redis-server if on PATH (or only $$REDIS_SERVER_BIN if set). Every run executes even
# if an earlier one failed; the target fails if any did.
pytest: venv
	@binaries="$$($(VPY) -m tests.servers --list)" || exit 1; \
	status=0; \
	for bin in $$binaries; do \
		echo ""; \
		echo "=== pytest against $$($$bin --version)"; \
		echo "=== REDIS_SERVER_BIN=$$bin"; \
		REDIS_SERVER_BIN="$$bin" $(VPY) -m pytest $(PYTEST_ARGS) || status=1; \
	done; \
	if [ $$status -ne 0 ]; then echo "=== pytest FAILED on at least one server"; fi; \
	exit $$status

# The fast subset on the oldest and newest supported Pythons (SPEC §7), against the bundled
# Valkey, each in its own .venv-X.Y with only the `test` extra. A version that is not installed
# (neither pythonX.Y on PATH nor under pyenv) is skipped with a note.
PY_SUBSET ?= 3.10 3.13
FAST_TESTS ?= tests/test_lock.py tests/test_keys.py
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
		bin="$$("$$venv/bin/python" -m tests.servers --list | head -n 1)"; \
		echo ""; echo "=== fast subset on $$("$$venv/bin/python" --version) against $$bin"; \
		REDIS_SERVER_BIN="$$bin" "$$venv/bin/python" -m pytest -q $(FAST_TESTS) || status=1; \
	done; \
	exit $$status

# Benchmarks are programs: a quick run (< 1 min) keeps them from rotting (STYLE §12).
bench-smoke: venv
	$(VPY) -m benchmarks --quick --out "$$(mktemp -d)"

test: lint typecheck bench-smoke pytest-pythons pytest

demo: $(STAMP_DEMO)
	$(VPY) -m redis_locks_async demo

bench: $(STAMP_BENCH)
	$(VPY) -m benchmarks

clean:
	rm -rf build dist .mypy_cache .ruff_cache .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) .venv-*
