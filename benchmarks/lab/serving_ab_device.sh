#!/bin/bash
# A short A/B of PATCHES for a session's last device seconds: `bench --serving --no-aot` patched / main / patched
# through the blobs of benchmarks/lab/ab_blobs.sh, then (CHECK_S seconds, default 160) the patched tree's
# whole-page GPU cases named by CHECK_K and the bounds suite, beside memcheck of tests/gpu/sanitize_wholepage.py.
# Everything packed into $OUT/ab.tgz after each phase.
. benchmarks/lab/ab_setup.sh
pack() { (cd $OUT && tar czf ab.tgz --exclude=ab.tgz --exclude=call.log $(ls | grep -v '^ab.tgz$\|^call.log$')); }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for n in new_1 main new_2; do serving_run $n
  grep -E "ceiling| us |no blob" $OUT/serving_$n.log | head -14; pack; done
S=${CHECK_S:-160}
timeout $S python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu/test_decode_wholepage_gpu.py tests/gpu/test_bounds_gpu.py \
  -k "${CHECK_K:-bounds or ragged or graph or window or token_major or garbage}" > $OUT/wp_gpu.log 2>&1 &
timeout $S compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize_wholepage.py > $OUT/san.log 2>&1 &
wait; el "checks done"; tail -n2 $OUT/wp_gpu.log; grep -h "^FAILED" $OUT/wp_gpu.log | head; grep -h "ERROR SUMMARY" $OUT/san.log
pack; find $OUT -type f ! -name ab.tgz ! -name call.log -delete
