"""ctypes bindings to the vendor driver APIs: just what loading and launching a code object needs.

Why ctypes and not a C extension: a wheel that ships only Python plus blobs has no C++ ABI to match,
so one wheel serves every Python and torch version (docs/runtime.md, "Why ctypes").

* CUDA: ``libcuda.so.1`` (the driver API). Modules are loaded into the device's *primary* context,
  the one PyTorch's runtime API uses, so pointers and streams from torch are valid for our kernels.
* HIP: ``libamdhip64.so``, and precisely the copy PyTorch already loaded (two HIP runtimes in one
  process do not see each other's modules). Untested here: no AMD GPU is in this project's reach.

Every driver return code is checked; a failure raises :class:`DriverError` naming the call and the
driver's own error name and text.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass

# CUDA driver enums used here (cuda.h).
CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
DEFAULT_SHARED_LIMIT = 49152
"""Dynamic shared memory a kernel may use without opting in (48 KiB, both vendors' default)."""


class DriverError(RuntimeError):
    """A driver call failed: carries the call name and the driver's status code."""

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        super().__init__(f"{call} failed: {name} ({code}): {text}")
        self.call = call
        self.code = code
        self.name = name


@dataclass
class DeviceInfo:
    """What the runtime needs to know about one device (index in torch's numbering)."""

    index: int
    arch: str
    name: str
    uuid: str
    driver_version: int


class Driver:
    """Common interface of the two vendor bindings (module load, function lookup, launch)."""

    vendor: str = ""
    driver_version: int = 0

    def load_module(self, device: int, image: bytes) -> int:
        """Load a code object on ``device``; return the module handle (never unloaded)."""
        raise NotImplementedError

    def get_function(self, device: int, module: int, symbol: str) -> int:
        """Return the function handle of ``symbol`` in ``module``."""
        raise NotImplementedError

    def prepare_function(self, device: int, function: int, dynamic_shared: int) -> None:
        """Opt the function in to ``dynamic_shared`` bytes of shared memory where needed."""

    def function_attributes(self, device: int, function: int) -> dict[str, int]:
        """Registers, static shared memory and max threads of a loaded function."""
        return {}

    def launch(self, device: int, function: int, grid: tuple[int, int, int], block: int,
               shared: int, stream: int, params: ctypes.Array) -> None:
        """Enqueue one launch on ``stream`` (no synchronization)."""
        raise NotImplementedError


class CudaDriver(Driver):
    """The CUDA driver API through ``libcuda.so.1``."""

    vendor = "cuda"

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        self.lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        L = self.lib
        vp, i32, u32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
        sigs = {
            "cuInit": [u32],
            "cuDriverGetVersion": [ctypes.POINTER(i32)],
            "cuDeviceGet": [ctypes.POINTER(i32), i32],
            "cuDeviceGetAttribute": [ctypes.POINTER(i32), i32, i32],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), i32],
            "cuCtxGetCurrent": [ctypes.POINTER(vp)],
            "cuCtxPushCurrent_v2": [vp],
            "cuCtxPopCurrent_v2": [ctypes.POINTER(vp)],
            "cuModuleLoadData": [ctypes.POINTER(vp), ctypes.c_char_p],
            "cuModuleGetFunction": [ctypes.POINTER(vp), vp, ctypes.c_char_p],
            "cuFuncGetAttribute": [ctypes.POINTER(i32), i32, vp],
            "cuFuncSetAttribute": [vp, i32, i32],
            "cuLaunchKernel": [vp, u32, u32, u32, u32, u32, u32, u32, vp, vp, vp],
            "cuGetErrorName": [i32, ctypes.POINTER(ctypes.c_char_p)],
            "cuGetErrorString": [i32, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, argtypes in sigs.items():
            fn = getattr(L, name)
            fn.argtypes = argtypes
            fn.restype = i32
        self._launch = L.cuLaunchKernel
        self._get_current = L.cuCtxGetCurrent
        self._check("cuInit", L.cuInit(0))
        v = ctypes.c_int()
        self._check("cuDriverGetVersion", L.cuDriverGetVersion(ctypes.byref(v)))
        self.driver_version = v.value
        self._contexts: dict[int, int] = {}
        self._lock = threading.Lock()
        self._tls = threading.local()

    def _current_context(self) -> int | None:
        """This thread's current context (a per-thread out-parameter: no allocation per launch)."""
        try:
            cur, ref = self._tls.cur
        except AttributeError:
            cur = ctypes.c_void_p()
            cur, ref = self._tls.cur = (cur, ctypes.byref(cur))
        self._get_current(ref)
        return cur.value

    def _check(self, call: str, code: int) -> None:
        if code == 0:
            return
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(name))
        self.lib.cuGetErrorString(code, ctypes.byref(text))
        raise DriverError(call, code, (name.value or b"CUDA_ERROR_UNKNOWN").decode(),
                          (text.value or b"no description").decode())

    def primary_context(self, device: int) -> int:
        """The primary context of CUDA ordinal ``device`` (the one torch uses), retained once."""
        ctx = self._contexts.get(device)
        if ctx is None:
            with self._lock:
                ctx = self._contexts.get(device)
                if ctx is None:
                    dev = ctypes.c_int()
                    self._check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(dev), device))
                    handle = ctypes.c_void_p()
                    self._check("cuDevicePrimaryCtxRetain",
                                self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(handle), dev.value))
                    ctx = self._contexts[device] = handle.value
        return ctx

    def _push(self, device: int) -> None:
        self._check("cuCtxPushCurrent", self.lib.cuCtxPushCurrent_v2(self.primary_context(device)))

    def _pop(self) -> None:
        old = ctypes.c_void_p()
        self._check("cuCtxPopCurrent", self.lib.cuCtxPopCurrent_v2(ctypes.byref(old)))

    def load_module(self, device: int, image: bytes) -> int:
        self._push(device)
        try:
            mod = ctypes.c_void_p()
            self._check("cuModuleLoadData", self.lib.cuModuleLoadData(ctypes.byref(mod), image))
            return mod.value
        finally:
            self._pop()

    def get_function(self, device: int, module: int, symbol: str) -> int:
        fn = ctypes.c_void_p()
        self._push(device)
        try:
            self._check(f"cuModuleGetFunction({symbol})",
                        self.lib.cuModuleGetFunction(ctypes.byref(fn), module, symbol.encode()))
        finally:
            self._pop()
        return fn.value

    def function_attributes(self, device: int, function: int) -> dict[str, int]:
        out = {}
        for key, attr in (("registers", CU_FUNC_ATTRIBUTE_NUM_REGS),
                          ("static_shared", CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
                          ("max_threads", CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)):
            v = ctypes.c_int()
            self._check("cuFuncGetAttribute", self.lib.cuFuncGetAttribute(ctypes.byref(v), attr, function))
            out[key] = v.value
        return out

    def prepare_function(self, device: int, function: int, dynamic_shared: int) -> None:
        if dynamic_shared <= DEFAULT_SHARED_LIMIT:
            return
        self._push(device)
        try:
            self._opt_in_shared(device, function, dynamic_shared)
        finally:
            self._pop()

    def _opt_in_shared(self, device: int, function: int, dynamic_shared: int) -> None:
        optin = ctypes.c_int()
        self._check("cuDeviceGetAttribute", self.lib.cuDeviceGetAttribute(
            ctypes.byref(optin), CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device))
        static = self.function_attributes(device, function)["static_shared"]
        if dynamic_shared + static > optin.value:
            raise DriverError("cuFuncSetAttribute", 1, "CUDA_ERROR_INVALID_VALUE",
                              f"kernel needs {dynamic_shared}+{static} B of shared memory, "
                              f"the device allows {optin.value}")
        self._check("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", self.lib.cuFuncSetAttribute(
            function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_shared))

    def launch(self, device: int, function: int, grid: tuple[int, int, int], block: int,
               shared: int, stream: int, params: ctypes.Array) -> None:
        # Fast path: this thread's current context is the device's primary context (the usual case:
        # torch made it current). Otherwise (another device, or a thread where nothing bound a
        # context yet) push it around the launch.
        cur = self._current_context()
        if cur is not None and cur == self._contexts.get(device):
            code = self._launch(function, grid[0], grid[1], grid[2], block, 1, 1, shared, stream,
                                params, None)
        else:
            self._push(device)
            try:
                code = self._launch(function, grid[0], grid[1], grid[2], block, 1, 1, shared, stream,
                                    params, None)
            finally:
                self._pop()
        if code:
            self._check("cuLaunchKernel", code)


def _loaded_hip_library() -> str | None:
    """Path of the libamdhip64 that this process (i.e. torch) already mapped, if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libamdhip64.so"):
                    return path
    except OSError:
        pass
    return None


class HipDriver(Driver):
    """The HIP module API through the ``libamdhip64.so`` that torch loaded (untested: no AMD GPU)."""

    vendor = "hip"

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        if lib is None:
            path = _loaded_hip_library()
            if path is None:
                raise OSError("libamdhip64.so is not loaded in this process (is this a ROCm torch?)")
            lib = ctypes.CDLL(path)
        self.lib = L = lib
        vp, i32, u32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
        sigs = {
            "hipInit": ([u32], i32),
            "hipDriverGetVersion": ([ctypes.POINTER(i32)], i32),
            "hipGetDevice": ([ctypes.POINTER(i32)], i32),
            "hipSetDevice": ([i32], i32),
            "hipModuleLoadData": ([ctypes.POINTER(vp), ctypes.c_char_p], i32),
            "hipModuleGetFunction": ([ctypes.POINTER(vp), vp, ctypes.c_char_p], i32),
            "hipModuleLaunchKernel": ([vp, u32, u32, u32, u32, u32, u32, u32, vp, vp, vp], i32),
            "hipGetErrorName": ([i32], ctypes.c_char_p),
            "hipGetErrorString": ([i32], ctypes.c_char_p),
        }
        for name, (argtypes, restype) in sigs.items():
            fn = getattr(L, name)
            fn.argtypes = argtypes
            fn.restype = restype
        self._launch = L.hipModuleLaunchKernel
        self._check("hipInit", L.hipInit(0))
        v = ctypes.c_int()
        self._check("hipDriverGetVersion", L.hipDriverGetVersion(ctypes.byref(v)))
        self.driver_version = v.value

    def _check(self, call: str, code: int) -> None:
        if code == 0:
            return
        name = self.lib.hipGetErrorName(code) or b"hipErrorUnknown"
        text = self.lib.hipGetErrorString(code) or b"no description"
        raise DriverError(call, code, name.decode(), text.decode())

    def _on_device(self, device: int):
        driver = self

        class _Guard:
            def __enter__(self):
                cur = ctypes.c_int()
                driver._check("hipGetDevice", driver.lib.hipGetDevice(ctypes.byref(cur)))
                self.old = cur.value
                if self.old != device:
                    driver._check("hipSetDevice", driver.lib.hipSetDevice(device))

            def __exit__(self, *exc):
                if self.old != device:
                    driver._check("hipSetDevice", driver.lib.hipSetDevice(self.old))

        return _Guard()

    def load_module(self, device: int, image: bytes) -> int:
        with self._on_device(device):
            mod = ctypes.c_void_p()
            self._check("hipModuleLoadData", self.lib.hipModuleLoadData(ctypes.byref(mod), image))
            return mod.value

    def get_function(self, device: int, module: int, symbol: str) -> int:
        fn = ctypes.c_void_p()
        self._check(f"hipModuleGetFunction({symbol})",
                    self.lib.hipModuleGetFunction(ctypes.byref(fn), module, symbol.encode()))
        return fn.value

    def launch(self, device: int, function: int, grid: tuple[int, int, int], block: int,
               shared: int, stream: int, params: ctypes.Array) -> None:
        cur = ctypes.c_int()
        self.lib.hipGetDevice(ctypes.byref(cur))
        if cur.value == device:
            code = self._launch(function, grid[0], grid[1], grid[2], block, 1, 1, shared, stream,
                                params, None)
        else:
            with self._on_device(device):
                code = self._launch(function, grid[0], grid[1], grid[2], block, 1, 1, shared, stream,
                                    params, None)
        if code:
            self._check("hipModuleLaunchKernel", code)


_DRIVER: Driver | None = None
_DRIVER_LOCK = threading.Lock()


def get_driver() -> Driver:
    """The process-wide driver binding for torch's GPU backend (CUDA or HIP), created once."""
    global _DRIVER
    if _DRIVER is None:
        with _DRIVER_LOCK:
            if _DRIVER is None:
                import torch

                _DRIVER = HipDriver() if torch.version.hip else CudaDriver()
    return _DRIVER


def device_info(index: int) -> DeviceInfo:
    """Arch string (``sm_90``, ``gfx942``), name, uuid and driver version of torch device ``index``."""
    import torch

    props = torch.cuda.get_device_properties(index)
    gcn = getattr(props, "gcnArchName", "") or ""
    arch = gcn.split(":")[0] if torch.version.hip else f"sm_{props.major}{props.minor}"
    uuid = str(getattr(props, "uuid", "") or f"index{index}")
    return DeviceInfo(index=index, arch=arch, name=props.name, uuid=uuid,
                      driver_version=get_driver().driver_version)
