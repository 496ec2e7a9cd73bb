#!/bin/bash
# Two stacked patch sets in one call: PATCHES (this tree, blobs .new/) and PATCHES + PATCHES2 (a copy, blobs
# .new2/; both from `PATCHES=.. PATCHES2=.. bash benchmarks/lab/ab_blobs.sh`): `bench --serving --no-aot` as new2 /
# main / new, twice, then the stacked tree's checks as serving_ab_device.sh's (CHECK_S, CHECK_K). Packed into
# $OUT/ab.tgz after each phase.
. benchmarks/lab/ab_setup.sh
pack() { (cd $OUT && tar czf ab.tgz --exclude=ab.tgz --exclude=call.log $(ls | grep -v '^ab.tgz$\|^call.log$')); }
T2=/tmp/tree2; rm -rf $T2 && mkdir $T2 && cp -r ultraquant runtime codegen tests pyproject.toml $T2/ && cp -r .new2 $T2/.new
for p in ${PATCHES2:?set PATCHES2}; do (cd $T2 && patch -p1 -s < "$OLDPWD/$p") && el "applied $p to the copy" || exit 3; done
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for i in 1 2; do
  (cd $T2 && serving_run new2_$i); serving_run main_$i; serving_run new_$i
  for n in new2_$i main_$i new_$i; do grep -E "ceiling| us |no blob" $OUT/serving_$n.log | head -14; done; pack; done
S=${CHECK_S:-160}
cd $T2 && export PYTHONPATH=$T2
timeout $S python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu/test_decode_wholepage_gpu.py tests/gpu/test_bounds_gpu.py \
  -k "${CHECK_K:-bounds or ragged or graph or window or token_major or garbage}" > $OUT/wp_gpu.log 2>&1 &
timeout $S compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize_wholepage.py > $OUT/san.log 2>&1 &
wait; el "checks done"; tail -n2 $OUT/wp_gpu.log; grep -h "^FAILED" $OUT/wp_gpu.log | head; grep -h "ERROR SUMMARY" $OUT/san.log
pack; find $OUT -type f ! -name ab.tgz ! -name call.log -delete
