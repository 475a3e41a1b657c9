"""A CPU matrix-vector product for decode steps: y = x W^T for 1 to 4 float32 rows against an output-major weight.

A CPU decode step is bound by reading its weights, which MKL's float32 product at one row streams well below what
a core can. The kernel is `kernels/cpu/gemv.c` (AVX-512, or AVX2 with FMA; OpenMP over the output rows), compiled
with `-march=native` at first use into the user's cache folder. Without a compiler or either instruction set,
`available()` is False and callers keep F.linear, as they do where the engine turns it off (threads=None) and for
products under MIN_WEIGHT weights (the ctypes call's overhead). Every row of x takes the same sums in the same
order, so a row's result does not depend on the rows beside it. Twin: F.linear."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MAX_ROWS = 4  # decode steps of up to 4 tokens (more rows: MKL's GEMM reuses each weight across them better)
# elements: a smaller product stays with F.linear, whose call overhead is a few times lower than this module's (checks,
# the output, the ctypes call); the crossover is in BENCHMARKS.md
MIN_WEIGHT = 1 << 17
PARALLEL_MIN_WEIGHT = 1 << 16  # elements (256 KB): a smaller weight runs on one thread (forking costs more)
_SOURCE = Path(__file__).parent / "cpu" / "gemv.c"


def available() -> bool:
    """The kernel is built for this machine (built at the first call)."""
    return _library() is not None


def can_run(x: torch.Tensor, weight: torch.Tensor, group: int = 1) -> bool:
    """Whether cpu_gemv serves F.linear(x, weight) (or `group` such products in one call): float32 CPU tensors, at
    most MAX_ROWS rows, the weight output-major (contiguous [N, K]; runner.model_runner stores weights input-major
    where this kernel is off) and at least MIN_WEIGHT elements in the call."""
    return (weight.numel() * group >= MIN_WEIGHT and x.dtype is torch.float32 and weight.dtype is torch.float32
            and x.is_cpu and weight.is_cpu and weight.dim() == 2 and weight.is_contiguous() and x.shape[-1] > 0
            and 0 < x.numel() <= MAX_ROWS * x.shape[-1] and not torch.compiler.is_compiling() and available())


def linear(x: torch.Tensor, weight: torch.Tensor, threads: int | None) -> torch.Tensor:
    """F.linear(x, weight) (no bias), through cpu_gemv on `threads` where can_run says it may; threads None: the
    kernel is off (F.linear)."""
    if threads is not None and can_run(x, weight):
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # checked by can_run: no second validation here
        return _launch(rows, 0, (weight,), threads).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def cpu_gemv(x: torch.Tensor, weight: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """x [..., K] float32 with at most MAX_ROWS rows, weight [N, K] float32 contiguous -> [..., N]. threads: those
    a product of PARALLEL_MIN_WEIGHT weights or more splits over (the bits do not depend on them)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return _run(rows, 0, [weight], threads).view(*x.shape[:-1], weight.shape[0])


def cpu_gemv_grouped(x: torch.Tensor, weights: list[torch.Tensor], threads: int = 1) -> torch.Tensor:
    """One call for several weights (a token's experts): x [M, K] for all of them or [G, M, K], one a weight;
    weights: G tensors [N, K] float32 contiguous -> [G, M, N] (each the bits cpu_gemv gives it alone)."""
    if x.dim() == 2:
        return _run(x.contiguous(), 0, weights, threads)
    if x.shape[0] != len(weights):
        raise ValueError(f"cpu_gemv_grouped: {x.shape[0]} inputs for {len(weights)} weights")
    x = x.contiguous()
    return _run(x, x.stride(0), weights, threads)


def _run(x: torch.Tensor, x_stride: int, weights: list[torch.Tensor], threads: int) -> torch.Tensor:
    """x [M, K] or [G, M, K] contiguous (x_stride: elements from one weight's x to the next; 0: shared)."""
    M, (N, K) = x.shape[-2], weights[0].shape
    if x.shape[-1] != K or any(w.shape != (N, K) or not w.is_contiguous() for w in weights):
        raise ValueError(f"cpu_gemv: x has {x.shape[-1]} columns; the weights must all be contiguous [N, {K}], "
                         f"got {[tuple(w.shape) for w in weights]}")
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (x, *weights)):
        raise ValueError("cpu_gemv takes float32 CPU tensors (can_run tells where it serves)")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"cpu_gemv takes 1 to {MAX_ROWS} rows, not {M}")
    return _launch(x, x_stride, weights, threads)


def _launch(x: torch.Tensor, x_stride: int, weights, threads: int) -> torch.Tensor:
    """The kernel on checked arguments (_run's): x [..., M, K] contiguous, weights G x [N, K] -> [G, M, N]."""
    (N, K), M, G = weights[0].shape, x.shape[-2], len(weights)
    y = torch.empty(G, M, N, dtype=torch.float32)
    pointers = (ctypes.c_void_p * G)(*[w.data_ptr() for w in weights])
    _library().gemv_f32(x.data_ptr(), x_stride, pointers, y.data_ptr(), G, M, K, N,
                        max(1, threads) if G * N * K >= PARALLEL_MIN_WEIGHT else 1)
    return y


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built once per machine and source (None where it cannot be built: a warning says why)."""
    try:
        try:
            path = _build(_cache_dir())
        except OSError:  # the cache folder cannot be written (a read-only home): a temporary one
            path = _build(Path(tempfile.gettempdir()) / f"deltaserve-kernels-{os.getuid()}")
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        logger.warning("cpu_gemv unavailable, decode steps use PyTorch's float32 products: %s", e)
        return None
    lib.gemv_f32.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                             ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    lib.gemv_f32.restype = ctypes.c_int
    return lib


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "deltaserve" / "kernels"


def _build(folder: Path) -> Path:
    """Compile gemv.c into folder (name: a hash of the source, compiler, flags and CPU), unless it is there."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"it is written for x86-64 (AVX2 or AVX-512), this machine is {platform.machine()}")
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler: {compiler!r} is not on PATH (set CC to one)")
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
    source = _SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
    parts = [source, compiler.encode(), version, " ".join(flags).encode(), _cpu_id()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()
    path = folder / f"cpu_gemv-{key[:16]}.so"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built beside, then renamed: readers never see half a file
        out = Path(tmp) / path.name
        done = subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(out)], capture_output=True, text=True,
                              errors="replace", timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(out, path)
    return path


def _cpu_id() -> bytes:
    """What -march=native builds for: the machine and its CPU's feature flags (a cache folder may be shared)."""
    flags = b""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            flags = next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        pass
    return platform.machine().encode() + flags
