"""The ctypes CUDA binding against a fake ``libcuda`` compiled from C at test time (CPU only).

The fake implements the driver entry points the runtime calls, with the real C signatures, and
records what it was given: which context was current at load and launch, the launch geometry, and
the bytes behind each kernel-parameter pointer. So the ctypes declarations, out-parameters, error
translation, context push/pop and argument pointer arrays are all exercised for real.
"""

from __future__ import annotations

import ctypes
import shutil
import struct
import subprocess

import pytest

from ultraquant.runtime.driver import CudaDriver, DriverError
from ultraquant.runtime.packing import ArgPacker, Param

FAKE_LIBCUDA = r"""
#include <stdint.h>
#include <string.h>
typedef int CUresult;
void *current = 0, *stack[16], *load_ctx = 0, *launch_ctx = 0, *last_stream = 0;
int sp = 0, pushes = 0, dyn_shared = -1, nparams = 0, psizes[64];
unsigned last_geom[7]; unsigned char last_params[1024];
CUresult cuInit(unsigned f) { return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return 0; }
CUresult cuDeviceGet(int *d, int o) { if (o > 1) return 101; *d = o; return 0; }
CUresult cuDeviceGetAttribute(int *v, int a, int d) { *v = a == 97 ? 232448 : 0; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { *c = (void *)(uintptr_t)(0x1000 + d); return 0; }
CUresult cuCtxGetCurrent(void **c) { *c = current; return 0; }
CUresult cuCtxPushCurrent_v2(void *c) { stack[sp++] = current; current = c; pushes++; return 0; }
CUresult cuCtxPopCurrent_v2(void **c) { *c = current; current = stack[--sp]; return 0; }
CUresult cuModuleLoadData(void **m, const void *img) {
  if (memcmp(img, "\x7f" "ELF", 4)) return 200;
  load_ctx = current; *m = (void *)(uintptr_t)(0x5000 + (uintptr_t)current); return 0; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
  if (strcmp(name, "uq_k")) return 500; *f = (char *)m + 1; return 0; }
CUresult cuFuncGetAttribute(int *v, int a, void *f) { *v = a == 1 ? 1024 : 0; return 0; }
CUresult cuFuncSetAttribute(void *f, int a, int v) { if (a == 8) dyn_shared = v; return 0; }
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
  if (!current) return 201;
  if (extra) return 1;
  launch_ctx = current; last_stream = stream;
  unsigned g[7] = {gx, gy, gz, bx, by, bz, shared}; memcpy(last_geom, g, sizeof g);
  int off = 0;
  for (int i = 0; i < nparams; i++) { memcpy(last_params + off, params[i], psizes[i]); off += psizes[i]; }
  return 0; }
CUresult cuGetErrorName(int e, const char **s) {
  *s = e == 201 ? "CUDA_ERROR_INVALID_CONTEXT" : e == 200 ? "CUDA_ERROR_INVALID_IMAGE"
     : e == 500 ? "CUDA_ERROR_NOT_FOUND" : "CUDA_ERROR_UNKNOWN"; return 0; }
CUresult cuGetErrorString(int e, const char **s) { *s = "fake description"; return 0; }
"""


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcuda")
    d = tmp_path_factory.mktemp("fakecuda")
    (d / "fake.c").write_text(FAKE_LIBCUDA)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "libfakecuda.so"), str(d / "fake.c")],
                   check=True)
    return ctypes.CDLL(str(d / "libfakecuda.so"))


def _ptr(lib, name):
    return ctypes.c_void_p.in_dll(lib, name).value


def _int(lib, name):
    return ctypes.c_int.in_dll(lib, name).value


@pytest.fixture
def cuda(fake):
    ctypes.c_void_p.in_dll(fake, "current").value = None
    return CudaDriver(lib=fake)


def test_init_and_module_load_in_the_primary_context(cuda, fake):
    assert cuda.driver_version == 12080
    mod = cuda.load_module(1, b"\x7fELF rest of a cubin \x00 with NULs")
    assert _ptr(fake, "load_ctx") == 0x1001 and _ptr(fake, "current") is None  # pushed, then popped
    assert mod == 0x5000 + 0x1001
    fn = cuda.get_function(1, mod, "uq_k")
    assert fn == mod + 1


def test_driver_errors_are_named(cuda):
    with pytest.raises(DriverError, match=r"cuModuleLoadData failed: CUDA_ERROR_INVALID_IMAGE \(200\)"):
        cuda.load_module(0, b"not a cubin")
    with pytest.raises(DriverError, match=r"cuModuleGetFunction\(missing\).*CUDA_ERROR_NOT_FOUND"):
        cuda.get_function(0, 0x5000, "missing")
    with pytest.raises(DriverError, match="cuDeviceGet.*CUDA_ERROR_UNKNOWN"):
        cuda.primary_context(7)


def test_large_shared_memory_opt_in(cuda, fake):
    cuda.prepare_function(0, 0x5001, 40000)
    assert _int(fake, "dyn_shared") == -1  # under 48 KiB: nothing to do
    cuda.prepare_function(0, 0x5001, 100000)
    assert _int(fake, "dyn_shared") == 100000
    with pytest.raises(DriverError, match="allows 232448"):
        cuda.prepare_function(0, 0x5001, 232000)


def test_launch_passes_geometry_stream_and_every_parameter(cuda, fake):
    params = [Param("p", "*u8", 8, 0), Param("n", "i32", 4, 8), Param("s", "fp32", 4, 12),
              Param("b", "i1", 1, 16), Param("q", "i64", 8, 24),
              Param("global_scratch", "*i8", 8, 32, hidden=True), Param("profile_scratch", "*i8", 8, 40, hidden=True)]
    sizes = (ctypes.c_int * len(params))(*(p.size for p in params))
    ctypes.memmove(ctypes.addressof(ctypes.c_int.in_dll(fake, "psizes")), sizes, ctypes.sizeof(sizes))
    ctypes.c_int.in_dll(fake, "nparams").value = len(params)
    cuda.load_module(0, b"\x7fELF")
    packer = ArgPacker(params, "uq_k")
    ptrs = packer.pack((0xDEADBEEF00, -7, 0.25, True, 1 << 50))
    pushes = _int(fake, "pushes")
    ctypes.c_void_p.in_dll(fake, "current").value = 0x1000  # torch made device 0's context current
    cuda.launch(0, 0x5001, (5, 6, 7), 128, 4096, 0xABCD, ptrs)
    assert _int(fake, "pushes") == pushes  # fast path: no push
    geom = list((ctypes.c_uint * 7).in_dll(fake, "last_geom"))
    assert geom == [5, 6, 7, 128, 1, 1, 4096] and _ptr(fake, "last_stream") == 0xABCD
    raw = bytes((ctypes.c_ubyte * 41).in_dll(fake, "last_params"))
    assert struct.unpack("<QifbQQQ", raw) == (0xDEADBEEF00, -7, 0.25, 1, 1 << 50, 0, 0)


def test_launch_on_another_device_pushes_its_context(cuda, fake):
    ctypes.c_int.in_dll(fake, "nparams").value = 0
    cuda.load_module(1, b"\x7fELF")
    ctypes.c_void_p.in_dll(fake, "current").value = 0x1000  # the thread is on device 0
    cuda.launch(1, 0x5001, (1, 1, 1), 32, 0, 0, (ctypes.c_void_p * 1)())
    assert _ptr(fake, "launch_ctx") == 0x1001 and _ptr(fake, "current") == 0x1000
    ctypes.c_void_p.in_dll(fake, "current").value = None  # a thread with no context bound yet
    cuda.launch(1, 0x5001, (1, 1, 1), 32, 0, 0, (ctypes.c_void_p * 1)())
    assert _ptr(fake, "launch_ctx") == 0x1001 and _ptr(fake, "current") is None


FAKE_LIBHIP = r"""
#include <stdint.h>
#include <string.h>
int dev = 0, load_dev = -1, launch_dev = -1, sets = 0, nparams = 0, psizes[64];
unsigned last_geom[7]; unsigned char last_params[1024];
int hipInit(unsigned f) { return 0; }
int hipDriverGetVersion(int *v) { *v = 60342; return 0; }
int hipGetDevice(int *d) { *d = dev; return 0; }
int hipSetDevice(int d) { if (d > 1) return 101; dev = d; sets++; return 0; }
int hipModuleLoadData(void **m, const void *img) {
  if (memcmp(img, "\x7f" "ELF", 4)) return 200; load_dev = dev; *m = (void *)(uintptr_t)(0x7000 + dev); return 0; }
int hipModuleGetFunction(void **f, void *m, const char *name) {
  if (strcmp(name, "uq_k")) return 500; *f = (char *)m + 1; return 0; }
int hipModuleLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
  launch_dev = dev; unsigned g[7] = {gx, gy, gz, bx, by, bz, shared}; memcpy(last_geom, g, sizeof g);
  int off = 0;
  for (int i = 0; i < nparams; i++) { memcpy(last_params + off, params[i], psizes[i]); off += psizes[i]; }
  return 0; }
const char *hipGetErrorName(int e) { return e == 200 ? "hipErrorInvalidImage" : e == 500 ? "hipErrorNotFound"
                                            : "hipErrorUnknown"; }
const char *hipGetErrorString(int e) { return "fake hip description"; }
"""


@pytest.fixture(scope="module")
def fake_hip(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libamdhip64")
    d = tmp_path_factory.mktemp("fakehip")
    (d / "fake.c").write_text(FAKE_LIBHIP)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "libfakehip.so"), str(d / "fake.c")], check=True)
    return ctypes.CDLL(str(d / "libfakehip.so"))


def test_hip_binding_loads_on_the_device_and_launches(fake_hip):
    from ultraquant.runtime.driver import HipDriver

    hip = HipDriver(lib=fake_hip)
    assert hip.driver_version == 60342
    mod = hip.load_module(1, b"\x7fELF hsaco")
    assert _int(fake_hip, "load_dev") == 1 and _int(fake_hip, "dev") == 0  # switched, then restored
    fn = hip.get_function(1, mod, "uq_k")
    with pytest.raises(DriverError, match="hipModuleLoadData failed: hipErrorInvalidImage"):
        hip.load_module(0, b"junk")
    with pytest.raises(DriverError, match=r"hipModuleGetFunction\(nope\).*hipErrorNotFound"):
        hip.get_function(0, mod, "nope")
    params = [Param("p", "*u8", 8, 0), Param("n", "i32", 4, 8)]
    sizes = (ctypes.c_int * 2)(8, 4)
    ctypes.memmove(ctypes.addressof(ctypes.c_int.in_dll(fake_hip, "psizes")), sizes, ctypes.sizeof(sizes))
    ctypes.c_int.in_dll(fake_hip, "nparams").value = 2
    ptrs = ArgPacker(params, "uq_k").pack((0x1234560, 99))
    hip.launch(1, fn, (3, 2, 1), 256, 65536, 0, ptrs)
    assert _int(fake_hip, "launch_dev") == 1 and _int(fake_hip, "dev") == 0
    assert list((ctypes.c_uint * 7).in_dll(fake_hip, "last_geom")) == [3, 2, 1, 256, 1, 1, 65536]
    assert struct.unpack("<Qi", bytes((ctypes.c_ubyte * 12).in_dll(fake_hip, "last_params"))) == (0x1234560, 99)
    sets = _int(fake_hip, "sets")
    ctypes.c_int.in_dll(fake_hip, "dev").value = 1
    hip.launch(1, fn, (1, 1, 1), 64, 0, 0, ptrs)
    assert _int(fake_hip, "sets") == sets  # already on device 1: no switching
