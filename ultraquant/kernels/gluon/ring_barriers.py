"""PROTOTYPE (issue 25, benchmarks/lab/multiquery_merge_barriers.patch; not validated on a GPU): drop the two
block-wide barriers Triton's membar pass puts around a stage loop's ring issue in the multi-query decode.

The stage loop's top (:func:`~.decode_wholepage._advance_ring`) is ``cp.async.wait_group; bar.sync`` (the
explicit barrier X: the stage about to be read landed for every thread, and every warp is past its reads of
the stage about to be overwritten), then ``_issue_stage``'s two ``cp.async`` groups into the next stage and
a commit. Membar cannot tell the two copies' row ranges apart (``memdesc_subslice`` of one reinterpreted
stage: a write-after-write barrier between them) nor the stage written from the stage read next
(``(it + STAGES - 1) % STAGES`` vs ``it % STAGES``: a read-after-write barrier after the commit). Both are
redundant after X (disjoint rows; a stage other than the one read; cp.async completion is ordered by the
next iterations' wait_group + X, not by a barrier at issue). This rewrites the PTX of ``uq_decode_multiquery``
only: after each ``cp.async.wait_group`` + ``bar.sync`` pair, the ``bar.sync`` lines up to and including the
first one after the next ``cp.async.commit_group`` go, if that window has ``cp.async`` and no other
shared-memory access, branch or label. ``ULTRAQUANT_MQ_KEEP_BARRIERS=1`` keeps them (A/B; Triton's cache key
does not see this hook: use ``TRITON_ALWAYS_COMPILE=1`` or a fresh ``TRITON_CACHE_DIR`` per variant).
"""

from __future__ import annotations

import os
import re

KERNEL = "uq_decode_multiquery"
_SHARED = re.compile(r"\b(ld|st|atom|red)\.shared\b|\bldmatrix\b|\bstmatrix\b|\bbra\b|^\s*\$L\w*:|\bret\b")
_BAR = re.compile(r"^\s*bar\.sync\s+0;")


def drop_issue_barriers(ptx: str) -> tuple[str, int]:
    """(``ptx`` without the redundant issue barriers, how many bar.sync were dropped)."""
    lines = ptx.split("\n")
    drop: set[int] = set()
    i = 0
    while i < len(lines):
        if "cp.async.wait_group" in lines[i] and i + 1 < len(lines) and _BAR.match(lines[i + 1]):
            window, committed, copies, ok, j = [], False, 0, True, i + 2
            while j < len(lines) and j < i + 2000:
                t = lines[j]
                if _BAR.match(t):
                    window.append(j)
                    if committed:
                        break
                elif "cp.async.commit_group" in t:
                    committed = True
                elif "cp.async." in t and "wait" not in t:
                    copies += 1
                elif "cp.async.wait" in t or _SHARED.search(t):
                    ok = False
                    break
                j += 1
            if ok and committed and copies and window and _BAR.match(lines[window[-1]]):
                drop.update(window)
            i = j if ok else i + 1
        i += 1
    return "\n".join(t for k, t in enumerate(lines) if k not in drop), len(drop)


def _install() -> None:
    import triton.knobs as knobs

    previous = knobs.runtime.add_stages_inspection_hook

    def hook(backend, stages, options, language, capability):
        if previous is not None:
            previous(backend, stages, options, language, capability)
        make_ptx = stages.get("ptx")
        if make_ptx is None or getattr(make_ptx, "_uq_ring_barriers", False):
            return

        def ptx_stage(src, metadata):
            ptx = make_ptx(src, metadata)
            if f".entry {KERNEL}(" in ptx and os.environ.get("ULTRAQUANT_MQ_KEEP_BARRIERS") != "1":
                ptx, _ = drop_issue_barriers(ptx)
            return ptx

        ptx_stage._uq_ring_barriers = True
        stages["ptx"] = ptx_stage

    hook._uq_ring_barriers = True
    if not getattr(previous, "_uq_ring_barriers", False):
        knobs.runtime.add_stages_inspection_hook = hook


_install()
