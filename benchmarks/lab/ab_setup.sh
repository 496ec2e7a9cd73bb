# Sourced by the device A/B scripts (patch_ab_device.sh, spec_ab_device.sh, quick_ab_device.sh, serving_ab_device.sh):
# environment, OUT and el, a pristine copy of main's tree with its blobs in /tmp/main_tree (MT), then PATCHES applied
# to this tree (exit 3 if one fails); serving_run, the A/B's one `bench --serving` run.
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
: "${PATCHES:?set PATCHES to the patch files to apply}"
MT=/tmp/main_tree; rm -rf $MT && mkdir $MT && cp -r ultraquant runtime codegen benchmarks pyproject.toml .blobs $MT/
for p in $PATCHES; do { git apply "$p" 2>/dev/null || patch -p1 -s < "$p"; } && el "applied $p" || exit 3; done
# serving_run N: `bench --serving --no-aot` into $OUT/serving_N.{json,log}, through the current tree's blobs (.new/)
# or, for N = main or main_*, main's tree and blobs
serving_run() { local d=$PWD g=$PWD/.new; [[ $1 == main || $1 == main_* ]] && d=$MT g=$MT/.blobs
  (cd $d && PYTHONPATH=$d ULTRAQUANT_GENERATED=$g timeout 100 python3 -m ultraquant.cli bench --serving --no-aot \
    --json $OUT/serving_$1.json > $OUT/serving_$1.log 2>&1); el "serving $1 rc=$?"; }
