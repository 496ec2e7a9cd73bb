#!/bin/bash
# A short A/B of PATCHES for a session's last device seconds: `bench --serving --no-aot` patched / main / patched
# through the blobs of benchmarks/lab/ab_blobs.sh, then (CHECK_S seconds, default 160) the patched tree's
# whole-page GPU cases named by CHECK_K and the bounds suite, beside memcheck of tests/gpu/sanitize_wholepage.py.
# With PATCHES2 (blobs .new2/ from ab_blobs.sh given the same PATCHES2): a second tree, PATCHES then PATCHES2, in a
# copy; the runs go new2 / main / new, twice, and the checks run on that stacked tree.
# Everything packed into $OUT/ab.tgz after each phase.
. benchmarks/lab/ab_setup.sh
pack() { (cd $OUT && tar czf ab.tgz --exclude=ab.tgz --exclude=call.log $(ls | grep -v '^ab.tgz$\|^call.log$')); }
CT=$PWD; RUNS="new_1 main new_2"
if [ -n "${PATCHES2:-}" ]; then
  CT=/tmp/tree2; rm -rf $CT && mkdir $CT && cp -r ultraquant runtime codegen tests pyproject.toml $CT/ && cp -r .new2 $CT/.new
  for p in $PATCHES2; do (cd $CT && patch -p1 -s < "$OLDPWD/$p") && el "applied $p to the copy" || exit 3; done
  RUNS="new2_1 main_1 new_1 new2_2 main_2 new_2"
fi
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for n in $RUNS; do if [[ $n == new2_* ]]; then (cd $CT && serving_run $n); else serving_run $n; fi
  grep -E "ceiling| us |no blob" $OUT/serving_$n.log | head -14; pack; done
S=${CHECK_S:-160}
cd $CT && export PYTHONPATH=$CT
timeout $S python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu/test_decode_wholepage_gpu.py tests/gpu/test_bounds_gpu.py \
  -k "${CHECK_K:-bounds or ragged or graph or window or token_major or garbage}" > $OUT/wp_gpu.log 2>&1 &
timeout $S compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize_wholepage.py > $OUT/san.log 2>&1 &
wait; el "checks done"; tail -n2 $OUT/wp_gpu.log; grep -h "^FAILED" $OUT/wp_gpu.log | head; grep -h "ERROR SUMMARY" $OUT/san.log
pack; find $OUT -type f ! -name ab.tgz ! -name call.log -delete
