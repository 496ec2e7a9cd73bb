"""Stall samples of one ncu source export (``ncu -i R --page source --csv --print-source sass``) split by region:
each loop (a backward ``BRA``: its target up to the branch) with its instructions, samples and stall reasons,
and the samples outside every loop. Names the stage loop (most ``HMMA``) and the merge loops (``LDG`` with
``STRONG.GPU``: the last program's partial loads), so a kernel's tail can be told from its stage loop.

    python3 benchmarks/lab/ncu_regions.py src.csv
"""

from __future__ import annotations

import collections
import re
import sys

from ncu_source_sum import load


def main() -> None:
    ins, _ = load(sys.argv[1])
    base = ins[0][0]
    total = max(1, sum(i[2] for i in ins))
    spans = set()
    for a, src, _, _, _ in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)\s*$", src)
        if m and int(m.group(1), 16) + (base if int(m.group(1), 16) < base else 0) <= a:
            t = int(m.group(1), 16)
            spans.add((t if t >= base else t + base, a))
    inner = sorted(spans, key=lambda s: s[1] - s[0])
    owner = {}
    for a, *_ in ins:
        owner[a] = next((s for s in inner if s[0] <= a <= s[1]), None)
    per: dict = collections.defaultdict(lambda: [0, 0, collections.Counter(), 0, 0])
    for a, src, smp, _, st in ins:
        r = per[owner[a]]
        r[0] += 1
        r[1] += smp
        r[2].update(st)
        r[3] += "HMMA" in src
        r[4] += "LDG" in src and "STRONG.GPU" in src
    print(f"regions ({total} samples):")
    for span, (n, smp, st, hmma, ldg) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        name = "outside loops" if span is None else f"loop {span[0] - base:x}-{span[1] - base:x}"
        kind = " [stage loop]" if hmma >= 16 else " [merge loop]" if ldg else ""
        reasons = ", ".join(f"{k} {100 * v / total:.1f}" for k, v in st.most_common(4))
        print(f"  {name}{kind}: {n} instructions, {100 * smp / total:.1f}% of samples ({reasons})")


if __name__ == "__main__":
    main()
