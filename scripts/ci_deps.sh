#!/usr/bin/env bash
# System packages some tests use (PostgreSQL server, Debian chromium for Playwright, systemd-analyze, jq).
# Idempotent; needs root + apt-get. Without them those tests skip (they say why).
set -uo pipefail
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
  echo "ci_deps: not root or no apt-get: skipping system packages"; exit 0
fi
need=()
command -v pg_ctl >/dev/null || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || need+=(postgresql)
command -v chromium >/dev/null || need+=(chromium)
# `systemd-analyze verify` checks the emitted units (tests/jobs/test_schedule.py); jq: README's first day
command -v systemd-analyze >/dev/null || need+=(systemd)
command -v jq >/dev/null || need+=(jq)
if ((${#need[@]})); then
  echo "ci_deps: installing ${need[*]}"
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null \
    || echo "ci_deps: apt-get install failed; dependent tests will skip"
fi
