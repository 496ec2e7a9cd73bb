# Sourced by the device scripts (OUT and el set): the GPU suites and sanitizers of the tree in parallel, A-D at
# block 64 compiled meanwhile (JIT, for a later timing), then their result lines. SUITES_S (default 330): the wall
# limit of every job when little device time is left (no block-64 compile then).
S=${SUITES_S:-330}
timeout $S python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu/test_decode_wholepage_gpu.py > $OUT/wp_gpu.log 2>&1 &
timeout $S python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu/test_spec_decode_gpu.py tests/gpu/test_bounds_gpu.py \
  tests/gpu/test_attention_gpu.py > $OUT/mq_gpu.log 2>&1 &
timeout $((S - 30)) compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize_wholepage.py > $OUT/san.log 2>&1 &
UQ_SANITIZE_BOUNDS=0 UQ_SANITIZE_CASES=1,2,3,4,6 timeout $((S - 30)) compute-sanitizer --tool racecheck --print-limit 20 \
  python3 tests/gpu/sanitize_wholepage.py > $OUT/race.log 2>&1 &
(timeout $((S * 190 / 330)) compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize_spec_decode.py > $OUT/mq_san.log 2>&1;
 timeout $((S * 130 / 330)) compute-sanitizer --tool racecheck --print-limit 20 python3 tests/gpu/sanitize_spec_decode.py >> $OUT/mq_san.log 2>&1) &
[ -n "${SUITES_S:-}" ] || (ULTRAQUANT_BACKEND=triton timeout 250 python3 -m ultraquant.cli bench --shapes A,B,C,D --layouts head \
  --no-stream > /dev/null 2>&1) &
wait; el "phase 1 done"
tail -n1 $OUT/wp_gpu.log; tail -n1 $OUT/mq_gpu.log; grep -h "^FAILED" $OUT/wp_gpu.log $OUT/mq_gpu.log | head
for f in san race mq_san; do echo "$f: $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' $OUT/$f.log | tr '\n' ' ')"; done
