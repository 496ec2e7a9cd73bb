#!/bin/bash
# Before patch_ab_device.sh (CPU, ~5 min), with the same PATCHES: the two sm_90 blob folders it carries,
# for the serving rows' shapes
# (six llama-style configs: 32/8 and 32/4, 32/2 D128, 16/2 D256, 16/1 and 8/1 D128; whole-page decode, multi-query
# decode and store at block 16): .new/ from HEAD with PATCHES applied in a scratch copy (skipped when PATCHES is
# empty), with PATCHES2 also .new2/ from HEAD with PATCHES then PATCHES2 (serving_ab_device.sh), .blobs/ from HEAD as
# it is. All are ignored (.git/info/exclude). Run in the repo root with the env of `make env`.
set -eu
ROOT=$PWD; PY=$ROOT/.venv/bin/python; M=$(mktemp -d); T=$(mktemp -d)
$PY - "$M" <<'PY'
import json, sys
for hq, hk, d in [(32, 8, 128), (32, 4, 128), (32, 2, 128), (16, 2, 256), (16, 1, 128), (8, 1, 128)]:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_attention_heads": hq,
           "num_key_value_heads": hk, "head_dim": d, "hidden_size": 4096, "num_hidden_layers": 2,
           "torch_dtype": "bfloat16", "intermediate_size": 16384, "vocab_size": 32000,
           "max_position_embeddings": 131072}
    json.dump(cfg, open(f"{sys.argv[1]}/m{hq}_{hk}_d{d}.json", "w"))
PY
MODELS=$(ls "$M"/*.json | paste -sd,)
build() { (cd "$1" && "$PY" -c "from ultraquant.cli import main; main()" build --arch sm_90 --model "$MODELS" --tp 1 \
  --block-sizes 16 --ops decode_attention_wholepage,store_kv,spec_decode_attention --out "$2" --no-cache -j 2); }
git archive HEAD | tar -x -C "$T"
for p in ${PATCHES:-}; do
  patch -d "$T" -p1 -s < "$p"; done
rm -rf .new .new2 .blobs
[ -z "${PATCHES:-}" ] || build "$T" "$ROOT/.new"
if [ -n "${PATCHES2:-}" ]; then  # serving_ab_device.sh's stacked tree: PATCHES then PATCHES2
  for p in $PATCHES2; do patch -d "$T" -p1 -s < "$p"; done; build "$T" "$ROOT/.new2"; fi
build "$ROOT" "$ROOT/.blobs"
for d in .new/ .new2/ .blobs/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
ls .blobs/sm_90 | wc -l; rm -rf "$M" "$T"
