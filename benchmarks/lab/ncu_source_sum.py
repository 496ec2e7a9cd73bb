"""Summary of ncu's per-instruction stall sampling (the SASS source page exported as CSV by
an ncu run exporting the SASS source page as CSV): where the samples fall (by how often an instruction ran, which
separates the hot loop from the once-per-warp prologue / epilogue), the hottest instructions and the
samples per opcode.

    python3 benchmarks/lab/ncu_source_sum.py src_C.csv [top]
"""

from __future__ import annotations

import collections
import csv
import sys


def load(path: str) -> tuple[list[tuple[int, str, int, int, dict[str, int]]], list[str]]:
    """(address, SASS text, samples, times executed, samples per stall reason) per instruction."""
    rows = list(csv.reader(open(path)))
    head = rows[1]
    ix = {h: i for i, h in enumerate(head)}
    reasons = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in rows[2:]:
        if len(r) < len(head):
            continue
        out.append((int(r[0], 16), " ".join(r[1].split()), int(r[ix["Warp Stall Sampling (All Samples)"]] or 0),
                    int(r[ix["Instructions Executed"]] or 0), {s[6:]: int(r[ix[s]] or 0) for s in reasons}))
    return out, reasons


def main() -> None:
    ins, _ = load(sys.argv[1])
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    base, total = ins[0][0], max(1, sum(i[2] for i in ins))
    print(f"{total} samples over {len(ins)} instructions")
    groups: dict[int, list] = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for _, _, smp, ex, st in ins:
        g = groups[ex]
        g[0] += 1
        g[1] += smp
        g[2].update(st)
    print("by times executed: instructions, share of samples, top stall reasons (share of all samples)")
    for ex, (n, smp, st) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:6]:
        reasons = ", ".join(f"{k} {100 * v / total:.1f}" for k, v in st.most_common(5))
        print(f"  {ex:>9}: {n:5d} {100 * smp / total:5.1f}%  {reasons}")
    print("hottest instructions:")
    for a, src, smp, ex, st in sorted(ins, key=lambda x: -x[2])[:top]:
        reasons = ", ".join(f"{k} {v}" for k, v in collections.Counter(st).most_common(2))
        print(f"  {a - base:6x} {100 * smp / total:5.2f}% x{ex:<7} {src[:58]:58s} {reasons}")
    ops: collections.Counter = collections.Counter()
    for _, src, smp, _, _ in ins:
        op = src.split()[1] if src.startswith("@") else (src.split() or [""])[0]
        ops[op.split(".")[0]] += smp
    print("by opcode:", ", ".join(f"{k} {100 * v / total:.1f}" for k, v in ops.most_common(15)))


if __name__ == "__main__":
    main()
