#!/usr/bin/env bash
# Installs everything the suite needs on a fresh machine, idempotently: Debian packages (Redis, Mosquitto and
# its clients, Chromium for the admin web UI's tests), the virtual environment with the pinned Python packages
# (requirements.lock) and every lib and service (editable), and the Kafka and Spark jars from Maven Central.
# Re-running is cheap: each step keeps a stamp of what it installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
stamps=.venv/.stamps

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v redis-cli >/dev/null || need_apt+=(redis-tools)
command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || need_apt+=(mosquitto)
command -v mosquitto_pub >/dev/null || need_apt+=(mosquitto-clients)
# headless browser of the admin web UI's tests (tests/e2e/admin; skipped without it)
command -v chromium >/dev/null || need_apt+=(chromium)
# a load balancer speaking the PROXY protocol, in front of the connector in tests/e2e/connector
command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || need_apt+=(haproxy)
# make test's lanes (scripts/test-lanes.sh): flock keeps their outputs apart, pkill stops them on a signal
command -v flock >/dev/null || need_apt+=(util-linux)
command -v pkill >/dev/null || need_apt+=(procps)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "bootstrap: apt-get install ${need_apt[*]}"
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_=sudo
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq "${need_apt[@]}" >/dev/null
  # Debian starts the packaged daemons; the suite runs its own on its own ports.
  $sudo_ systemctl disable --now redis-server mosquitto haproxy >/dev/null 2>&1 || true
fi

py=${PYTHON311:-python3.11}
command -v "$py" >/dev/null || py=python3
[ -x .venv/bin/python ] || "$py" -m venv .venv
mkdir -p "$stamps"
lock_sum=$(cat requirements.lock libs/*/pyproject.toml services/*/pyproject.toml spark/pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamps/pip-$lock_sum" ]; then
  echo "bootstrap: pip install (requirements.lock + libs + services)"
  .venv/bin/pip install -q -r requirements.lock
  eds=(); for d in libs/* services/* spark; do [ -f "$d/pyproject.toml" ] && eds+=(-e "$d"); done
  .venv/bin/pip install -q --no-deps --no-build-isolation "${eds[@]}"
  rm -f "$stamps"/pip-*; touch "$stamps/pip-$lock_sum"
fi

for part in kafka spark; do
  pom=infra/$part/pom.xml
  [ -f "$pom" ] || continue
  sum=$(sha256sum "$pom" | cut -c1-16)
  # re-fetch when the pom changed or the copied jars are gone (e.g. `make clean`); Maven keeps them in
  # ~/.m2, so a re-run needs no network
  if [ ! -f "$stamps/mvn-$part-$sum" ] || [ ! -d "infra/$part/target" ] || \
     { [ "$part" = kafka ] && ! ls infra/kafka/target/libs/kafka_2.13-*.jar >/dev/null 2>&1; }; then
    echo "bootstrap: mvn fetch of the $part jars"
    mvn -q -B -f "$pom" dependency:copy-dependencies
    rm -f "$stamps"/mvn-$part-*; touch "$stamps/mvn-$part-$sum"
  fi
done
echo "bootstrap: ready"
