# ncu of decode v8 on shape $SHAPE (default A; issue 14: occupancy, DRAM %, stall reasons): the stream's launches are
# skipped, the decode's first launch is profiled; writes $OUT/ncu/ncu_v8_A.txt (MATH=... not needed)
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/ncu
timeout 150 ncu --clock-control none -k "regex:uq_decode_v8" --launch-skip 2 -c 1 --section SpeedOfLight \
  --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats \
  --section InstructionStats --section MemoryWorkloadAnalysis --metrics \
  smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_dispatch_stall,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_tex_throttle,smsp__pcsamp_warps_issue_stalled_membar,smsp__pcsamp_warps_issue_stalled_branch_resolving,smsp__pcsamp_warps_issue_stalled_no_instructions,smsp__pcsamp_warps_issue_stalled_drain,smsp__pcsamp_warps_issue_stalled_sleeping,smsp__pcsamp_warps_issue_stalled_imc_miss,smsp__pcsamp_warps_issue_stalled_misc \
  python3 tools/v8_ncu.py ${SHAPE:-A} > $OUT/ncu/ncu_v8_${SHAPE:-A}.txt 2>&1
echo rc=$?
sed -n '/Section: Warp State Statistics/,/Section: /p' $OUT/ncu/ncu_v8_${SHAPE:-A}.txt | cut -c1-160 | head -30
grep -E "Duration|DRAM Throughput|Registers Per|Issued Warp|No Eligible|Eligible Warps|Executed Ipc|pcsamp" $OUT/ncu/ncu_v8_${SHAPE:-A}.txt | head -40
