#!/usr/bin/env bash
# On the lent GPU machine: collect the vLLM bundle (scripts/gpu/vllm_bundle.sh) one part per device call,
# outside the checkout (the checkout is replaced by each call; /tmp survives while the machine is warm),
# and unpack it into VLLM_SITE once every part named in SHA256SUMS is there and matches.
#
#   bash scripts/gpu/vllm_unpack.sh CARRIED_DIR      # CARRIED_DIR holds SHA256SUMS and >= 1 part
#
# A carried modelopt.tar.xz (with SHA256SUMS.modelopt) is unpacked at once into MODELOPT_SITE (default
# /tmp/msite): the quantizer runs before the engine's last part arrives.
#
# Exit 0: the site is ready (prints "vllm site ready"); 3: parts are still missing (prints which);
# 1: a sum does not match (the part is dropped, so the next call can carry it again).
set -uo pipefail
SRC=${1:?carried dir}
PARTS=${VLLM_PARTS:-/tmp/vparts}
SITE=${VLLM_SITE:-/tmp/vsite}
MSITE=${MODELOPT_SITE:-/tmp/msite}
mkdir -p "$PARTS"
if [ -e "$SRC/modelopt.tar.xz" ] && [ ! -e "$MSITE/.ok" ]; then
    (cd "$SRC" && sha256sum -c --quiet SHA256SUMS.modelopt) || { echo "modelopt.tar.xz: checksum mismatch" >&2; exit 1; }
    rm -rf "$MSITE" && mkdir -p "$MSITE" && xz -dc "$SRC/modelopt.tar.xz" | tar -C "$MSITE" -xf - && touch "$MSITE/.ok"
    echo "modelopt site ready: $MSITE"
fi
[ -e "$SITE/.ok" ] && { echo "vllm site ready: $SITE (already)"; exit 0; }
cp -f "$SRC"/SHA256SUMS "$PARTS"/
for f in "$SRC"/vllm.tar.xz.*; do [ -e "$f" ] && cp -f "$f" "$PARTS"/; done
cd "$PARTS" || exit 1
missing=()
while read -r sum name; do
    if [ ! -e "$name" ]; then
        missing+=("$name")
    elif [ "$(sha256sum "$name" | cut -d' ' -f1)" != "$sum" ]; then
        echo "checksum mismatch: $name (dropped)" >&2
        rm -f "$name"
        exit 1
    fi
done <SHA256SUMS
if [ ${#missing[@]} -gt 0 ]; then
    echo "vllm bundle: have $(ls vllm.tar.xz.* 2>/dev/null | wc -l), missing ${missing[*]}"
    exit 3
fi
rm -rf "$SITE" && mkdir -p "$SITE"
cat $(cut -d' ' -f3 SHA256SUMS) | xz -dc | tar -C "$SITE" -xf - || exit 1
touch "$SITE/.ok"
echo "vllm site ready: $SITE ($(du -sh "$SITE" | cut -f1))"
