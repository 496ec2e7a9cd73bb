"""Kernel name -> Triton JITFunction, and the Triton JIT launcher of a LaunchPlan (imports triton).

``KERNELS`` is derived from the one family table (:data:`.catalog.FAMILIES`); codegen compiles
``KERNELS[spec.kernel]`` with ``spec.signature``/``spec.constexprs``; the JIT path runs
:func:`jit_launch`. Under ``TRITON_INTERPRET=1`` (set before this module is first imported) the same
kernels run on CPU tensors through Triton's interpreter, which is how CI tests them.
"""

from __future__ import annotations

from typing import Any

from triton import knobs

from ..errors import UltraQuantError
from .catalog import FAMILIES, source_function
from .specialization import LaunchPlan

KERNELS: dict[str, Any] = {f.kernel: source_function(f.kernel) for f in FAMILIES if f.source}
"""Every Triton/Gluon kernel a Specialization may name."""


def get_kernel(name: str) -> Any:
    """The Triton/Gluon function of kernel ``name`` (codegen's lookup)."""
    if name not in KERNELS:
        raise UltraQuantError(f"kernel {name!r} has no Triton source (kernels: {', '.join(KERNELS)})")
    return KERNELS[name]


def _interpreter_fixes() -> None:
    """Work around two Triton 3.6 interpreter defects (only under TRITON_INTERPRET=1).

    * scalar tensors become ints through ``int(array_of_shape_1)``, which NumPy >= 2.4 rejects, so
      loops with tensor bounds fail: re-patch ``__index__`` through ``.item()``;
    * bf16 is stored as raw uint16 bits and ``tl.dot`` / casts other than bf16<->fp32 use those bits
      as integers: route every bf16 dot operand and cast through float32.
    No-op when the hooks are absent (another Triton version).
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as itp

    orig_patch = getattr(itp, "_patch_lang_tensor", None)
    builder = getattr(itp, "InterpreterBuilder", None)
    convert = getattr(itp, "_convert_float", None)
    if orig_patch is None or builder is None or convert is None or getattr(builder, "_uq_fixed", False):
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    itp._patch_lang_tensor = patch_lang_tensor

    def as_f32(h: Any) -> Any:
        if h.dtype.scalar == tl.bfloat16:
            return itp.TensorHandle(convert(h.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)
        return h

    orig_dot = builder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        return orig_dot(self, as_f32(a), as_f32(b), d, input_precision, max_num_imprecise_acc)

    orig_cast = builder.cast_impl

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        s_ty, d_ty = src.dtype.scalar, dst_type.scalar
        if s_ty == tl.bfloat16 and d_ty != tl.float32 and d_ty != tl.bfloat16:
            return orig_cast(self, as_f32(src), dst_type)
        if d_ty == tl.bfloat16 and s_ty != tl.float32 and s_ty != tl.bfloat16:
            return orig_cast(self, orig_cast(self, src, tl.float32), dst_type)
        return orig_cast(self, src, dst_type)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    builder._uq_fixed = True


if knobs.runtime.interpret:
    _interpreter_fixes()


def jit_launch(plan: LaunchPlan) -> None:
    """Run ``plan`` through Triton's JIT (Gluon's for the whole-page decode; compiles on first use per
    specialization, then caches)."""
    fn = KERNELS[plan.spec.kernel]
    extra = {} if plan.spec.maxnreg is None else {"maxnreg": plan.spec.maxnreg}
    fn[plan.grid](*plan.args, **plan.spec.constexprs, num_warps=plan.spec.num_warps,
                  num_stages=plan.spec.num_stages, **extra)
