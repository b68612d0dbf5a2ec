# Common loops. Rust build products live outside the clone so rebuilds stay incremental.
export CARGO_TARGET_DIR ?= $(HOME)/.cache/dilaserve/target
PYTHON ?= python3

.PHONY: build-deps install run test test-rust test-python lint bench wheel

# cmake and libclang for the HiGHS build (installed from Debian if missing).
build-deps:
	.ci/build-deps

# Editable install with test extras; pip skips what is already installed (torch is large).
install: build-deps
	$(PYTHON) -m pip install -e '.[test]'

# The main job: the OpenAI-compatible server on the embedded dilaserve-tiny, with the
# instances that fit this machine, on http://127.0.0.1:8000 until Ctrl-C.
run: build-deps
	$(PYTHON) -m pip install -e .
	dilaserve serve

test: install test-rust test-python

# Both MILP backends, so the HiGHS/microlp agreement tests run too.
test-rust: build-deps
	cargo test --release --features microlp

test-python:
	$(PYTHON) -m pytest -q

lint:
	cargo fmt --check
	cargo clippy --all-targets --features python,microlp -- -D warnings
	$(PYTHON) -m ruff check python tests benches kernels
	$(PYTHON) -m ruff format --check python tests benches kernels

bench:
	for b in benches/*.py; do $(PYTHON) $$b || exit 1; done

# The manylinux_2_28 abi3 wheel a user pip-installs: zig (ziglang, a test extra) compiles and
# links against glibc 2.28, so the wheel runs on any Linux since then; `auditwheel show` checks
# it. Its own target directory keeps the editable build's artifacts.
WHEEL_DIR ?= dist
wheel: build-deps
	CARGO_TARGET_DIR=$(CARGO_TARGET_DIR)/manylinux $(PYTHON) -m maturin build --release --locked \
		--zig --compatibility manylinux_2_28 --out $(WHEEL_DIR)
	$(PYTHON) -m auditwheel show $(WHEEL_DIR)/dilaserve-*.whl
