# Per-instruction stall sampling of decode v8 on shapes $SHAPES (default "A C"; issue 14): ncu's source
# counters of the decode's first launch (tools/v8_ncu.py), exported as the SASS source page in CSV
# (one row per instruction: its stall samples by reason), for `tools/ncu_source_sum.py`. Writes
# $OUT/ncu/src_<shape>.csv (and the report). From the repo root: bash tools/v8_ncu_source_device.sh
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/ncu
for s in ${SHAPES:-A C}; do
  timeout ${NCU_S:-150} ncu --clock-control none -k "regex:uq_decode_v8" --launch-skip 2 -c 1 \
    --section SourceCounters --section WarpStateStats -f -o $OUT/ncu/src_$s python3 tools/v8_ncu.py $s \
    > $OUT/ncu/src_$s.log 2>&1
  echo "$s profile rc=$?"; tail -3 $OUT/ncu/src_$s.log
  timeout 60 ncu -i $OUT/ncu/src_$s.ncu-rep --page source --csv --print-source sass > $OUT/ncu/src_$s.csv 2>&1
  echo "$s export rc=$? $(wc -l < $OUT/ncu/src_$s.csv) lines"; head -c 600 $OUT/ncu/src_$s.csv; echo
done
