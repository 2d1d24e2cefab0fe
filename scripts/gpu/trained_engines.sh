#!/usr/bin/env bash
# Calls 3-4 of the trained-base sequence (scripts/gpu/trained_call.sh says the order): unpack the vLLM bundle
# once its last parts are carried, then plan trained (benchmarks/vllm_h200/trained.py) with the task adapters of
# the background job, one engine at a time; a second call continues where the first stopped (results reused).
#
#   OUT=... bash scripts/gpu/trained_engines.sh [DEADLINE_S]      # carry the vLLM parts not carried before
#
# Returns 5 files ($OUT gives back 8 at most): vllm_h200.json, driver.log, adapters.json, packing_check.json and
# rest.tgz (host facts, engine logs, every stage's JSON, the background jobs' logs).
set -uo pipefail
: "${OUT:?OUT must name the results folder}"
DEADLINE=${1:-450}
cd "$(dirname "$0")/../.."
if [ -d .whl/vllm ] && [ ! -e /tmp/vsite/.ok ]; then
    bash scripts/gpu/vllm_unpack.sh .whl/vllm | tail -2
fi
rm -rf /tmp/eo && mkdir -p /tmp/eo/w
OUT=/tmp/eo/w bash scripts/gpu/trained_call.sh wait 0 | tail -4
BASE=/dev/shm/tb TASK_ADAPTERS=/tmp/ta/adapters.json EXTRA_SITE=/tmp/msite OUT=/tmp/eo/v \
    bash scripts/gpu/vllm_call.sh trained "$DEADLINE"
rc=$?
cp /tmp/eo/v/vllm_h200.json /tmp/eo/v/driver.log "$OUT/" 2>/dev/null
cp /tmp/eo/w/packing_check.json /tmp/eo/w/adapters.json "$OUT/" 2>/dev/null
tar czf "$OUT/rest.tgz" -C /tmp/eo . 2>/dev/null
exit $rc
