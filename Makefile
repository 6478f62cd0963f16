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
	@echo "make bench   the benchmark: tbmq-py, Mosquitto, amqtt in both cpu layouts (whole machine, one core)"
	@echo "             (BENCH_ARGS='--quick' smoke run; '--layout whole|one-core|both'; see: $(PY) -m bench run -h)"
	@echo "             $(PY) -m bench doc bench/results/<stamp>.json --write   regenerates docs/performance.md's results"

bootstrap:
	@scripts/bootstrap.sh

run: bootstrap
	$(PY) -m tbmq_launcher run $(RUN_ARGS)

# Unit, integration and end-to-end tests run as three pytest sessions, each with its own Kafka broker: the
# end-to-end tests leave large backlogs in the static topics (tbmq.msg.persisted, tbmq.client.session, ...)
# that a fresh consumer group of an integration test would otherwise have to read through first.
# The sessions run in two lanes side by side (scripts/test-lanes.sh): unit then integration in one, end-to-end
# in the other; one session keeps the 2-core host busy only about half of the time. TEST_LANES is one quoted
# string per lane (TEST_LANES="'tests/unit tests/integration tests/e2e'" runs them one after the other).
# All three always run; the target fails if any of them failed.
TEST_LANES ?= 'tests/unit tests/integration' 'tests/e2e'

test: bootstrap
	@scripts/test-lanes.sh $(PYTEST) $(TEST_LANES)

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
