# The two commands of the README: `make run` (the whole suite, MQTT on localhost:1883) and `make test`
# (every test). Both run scripts/bootstrap.sh first (apt-get, venv + pip, Maven jars; cheap when done).
SHELL := /bin/bash
PY := .venv/bin/python
PYTEST := .venv/bin/pytest
RUN_ARGS ?=
PYTEST_ARGS ?=

.PHONY: run test test-unit test-integration bootstrap proto bench clean help

help:
	@echo "make run     start Kafka, Redis and every service (MQTT localhost:1883); Ctrl-C stops all"
	@echo "             (RUN_ARGS='--connectors 2 --redis-cluster --fresh' ...; see: $(PY) -m tbmq_launcher run -h)"
	@echo "make test    every test under tests/ (PYTEST_ARGS='-k kafka' ...)"
	@echo "make proto   regenerate libs/tbmq-proto from proto/"
	@echo "make bench   the benchmark"

bootstrap:
	@scripts/bootstrap.sh

run: bootstrap
	$(PY) -m tbmq_launcher run $(RUN_ARGS)

test: bootstrap
	$(PYTEST) $(PYTEST_ARGS)

test-unit: bootstrap
	$(PYTEST) tests/unit $(PYTEST_ARGS)

test-integration: bootstrap
	$(PYTEST) tests/integration $(PYTEST_ARGS)

proto: bootstrap
	scripts/gen-proto.sh

bench: bootstrap
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf .run infra/*/target .pytest_cache
