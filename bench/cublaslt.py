"""16-bit products through cuBLASLt with an algorithm named by the caller, for ``lt_products.py``.

``F.linear`` launches the kernel cuBLAS's heuristic names first. cuBLASLt lists other candidates for the same
shape (``cublasLtMatmulAlgoGetHeuristic``: other tiles, stage counts, split-K with its reduction), and a
candidate can be run by name (``cublasLtMatmul`` with that algorithm), so that each can be timed. This module
holds the few calls that takes, through ctypes on the cuBLASLt library torch itself loaded:

* ``LtProduct(m, n, k, dtype)``: ``out[m, n] = x[m, k] @ w[n, k]^T`` (``F.linear``'s layout) on the current GPU.
  ``candidates(count)`` lists the algorithms cuBLASLt offers; ``run(x, w, out, algo)`` launches one on the current
  stream (capturable in a CUDA graph: the workspace is fixed).
* ``describe(algo)``: the tile, stages and split-K of a candidate, for logs and benchmarks.

Row-major tensors are column-major ones transposed, so ``out^T = w @ x^T`` is computed: A is the weight
(``[k, n]`` column-major with leading dimension k, transposed by the op), B is x (``[k, m]``, not transposed), D is
out (``[n, m]``).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os

import torch

# Values from cublasLt.h, cublas_api.h and library_types.h (stable across CUDA 11-13).
_CUBLAS_COMPUTE_32F = 68
_CUDA_R_32F = 0
_CUDA_TYPES = {torch.bfloat16: 14, torch.float16: 2}  # CUDA_R_16BF, CUDA_R_16F
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t
# cublasLtMatmulAlgoConfigAttributes_t: what ``describe`` reads
_CONFIG_ID, _CONFIG_TILE_ID, _CONFIG_SPLITK_NUM, _CONFIG_REDUCTION_SCHEME, _CONFIG_STAGES_ID = 0, 1, 2, 3, 6
_CONFIG_CLUSTER_SHAPE_ID = 8
WORKSPACE_BYTES = 32 << 20  # what split-K candidates may use for their partial sums (cuBLAS's default on Hopper)


class _Algo(ctypes.Structure):  # cublasLtMatmulAlgo_t: opaque, 64 bytes
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


def _library_path() -> str:
    """The cuBLASLt torch loaded (so that both use one library), else one found beside torch's CUDA wheels."""
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcublasLt.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    site = os.path.dirname(os.path.dirname(torch.__file__))
    found = sorted(glob.glob(os.path.join(site, "nvidia", "**", "libcublasLt.so*"), recursive=True))
    if found:
        return found[-1]
    return "libcublasLt.so"


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(_library_path())
    p, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(p), i, i],
        "cublasLtMatmulDescSetAttribute": [p, i, p, sz],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(p), i, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulPreferenceSetAttribute": [p, i, p, sz],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, ctypes.POINTER(_Heuristic), ctypes.POINTER(i)],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(_Algo), p, sz, p],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), i, p, sz, ctypes.POINTER(sz)],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"cuBLASLt: {what} failed with status {status}")


@functools.lru_cache(maxsize=None)
def _handle(device_index: int) -> int:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle.value


@functools.lru_cache(maxsize=None)
def _workspace(device_index: int) -> torch.Tensor:
    """One workspace per GPU, shared by every call: calls on one stream run one after another."""
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", device_index))


class LtProduct:
    """``x[m, k] @ w[n, k]^T`` for one shape and dtype, contiguous operands, on the current GPU."""

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype):
        if dtype not in _CUDA_TYPES:
            raise ValueError(f"LtProduct: 16-bit dtypes only, got {dtype}")
        self.m, self.n, self.k, self.dtype = m, n, k, dtype
        self.device_index = torch.cuda.current_device()
        lib, cuda_type = _lib(), _CUDA_TYPES[dtype]
        self._handle = _handle(self.device_index)
        self._desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F),
               "cublasLtMatmulDescCreate")
        for attr, value in ((_DESC_TRANSA, _CUBLAS_OP_T), (_DESC_TRANSB, _CUBLAS_OP_N)):
            op = ctypes.c_int32(value)
            _check(lib.cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(op), ctypes.sizeof(op)),
                   "cublasLtMatmulDescSetAttribute")
        # (rows, cols, leading dimension) of A = w, B = x and D = out, column-major
        self._a, self._b, self._d = (self._layout(cuda_type, *dims) for dims in ((k, n, k), (k, m, k), (n, m, n)))
        self._pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self._pref)), "cublasLtMatmulPreferenceCreate")
        limit = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(self._pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit),
                                                        ctypes.sizeof(limit)), "cublasLtMatmulPreferenceSetAttribute")
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _layout(cuda_type: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        _check(_lib().cublasLtMatrixLayoutCreate(ctypes.byref(layout), cuda_type, rows, cols, ld),
               "cublasLtMatrixLayoutCreate")
        return layout

    def candidates(self, count: int = 32) -> list[_Algo]:
        """Up to ``count`` algorithms cuBLASLt offers for this shape, its own first pick first."""
        results = (_Heuristic * count)()
        returned = ctypes.c_int(0)
        _check(_lib().cublasLtMatmulAlgoGetHeuristic(
            self._handle, self._desc, self._a, self._b, self._d, self._d, self._pref, count, results,
            ctypes.byref(returned)), "cublasLtMatmulAlgoGetHeuristic")
        return [_copy_algo(r.algo) for r in results[: returned.value] if r.state == 0
                and r.workspace_size <= WORKSPACE_BYTES]

    def run(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, algo: _Algo) -> torch.Tensor:
        """Launch ``algo`` on the current stream: x [m, k], w [n, k] and out [m, n], contiguous, of this dtype."""
        for t, shape in ((x, (self.m, self.k)), (w, (self.n, self.k)), (out, (self.m, self.n))):
            if t.shape != shape or not t.is_contiguous() or t.dtype != self.dtype:
                raise ValueError(f"LtProduct.run: want contiguous {self.dtype} {shape}, got {t.dtype} "
                                 f"{tuple(t.shape)} (contiguous: {t.is_contiguous()})")
        workspace = _workspace(self.device_index)
        stream = torch.cuda.current_stream(self.device_index).cuda_stream
        _check(_lib().cublasLtMatmul(
            self._handle, self._desc, ctypes.byref(self._alpha), w.data_ptr(), self._a, x.data_ptr(), self._b,
            ctypes.byref(self._beta), out.data_ptr(), self._d, out.data_ptr(), self._d, ctypes.byref(algo),
            workspace.data_ptr(), WORKSPACE_BYTES, stream), "cublasLtMatmul")
        return out


def _copy_algo(algo: _Algo) -> _Algo:
    copy = _Algo()
    ctypes.memmove(ctypes.byref(copy), ctypes.byref(algo), ctypes.sizeof(_Algo))
    return copy


def describe(algo: _Algo) -> str:
    """``id/tile/stages/splitK/reduction/cluster`` of a candidate: cuBLASLt's enum values, enough to tell two apart."""
    values = []
    for attr, kind in ((_CONFIG_ID, ctypes.c_int32), (_CONFIG_TILE_ID, ctypes.c_uint32),
                       (_CONFIG_STAGES_ID, ctypes.c_uint32), (_CONFIG_SPLITK_NUM, ctypes.c_int32),
                       (_CONFIG_REDUCTION_SCHEME, ctypes.c_uint32), (_CONFIG_CLUSTER_SHAPE_ID, ctypes.c_uint16)):
        value, written = kind(0), ctypes.c_size_t(0)
        status = _lib().cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                              ctypes.sizeof(value), ctypes.byref(written))
        values.append(str(value.value) if status == 0 else "?")
    return "/".join(values)
