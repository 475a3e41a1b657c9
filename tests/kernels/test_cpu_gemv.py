"""kernels.cpu_gemv (the compiled CPU matrix-vector product) against its twin F.linear, on fresh random inputs at ragged
shapes, and the fallback to F.linear where it cannot be built."""

import ctypes
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from deltaserve.kernels import cpu_gemv

needs_kernel = pytest.mark.skipif(not cpu_gemv.available(), reason="no C compiler or no AVX2/AVX-512 here")

# K: below one vector strip, a strip +- 1, ragged; N: 1, ragged, above the one-thread limit
SHAPES = [(1, 1), (7, 3), (63, 5), (64, 17), (65, 33), (300, 129), (1024, 511), (257, 1031)]


def _reference(x, w):
    return (x.double() @ w.double().t()).float()


@needs_kernel
@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_twin_at_ragged_shapes(K, N, rows, threads, monkeypatch):
    monkeypatch.setattr(cpu_gemv, "PARALLEL_MIN_WEIGHT", 0)  # the split at every size
    gen = torch.Generator().manual_seed(K * 1000 + N * 10 + rows)
    x, w = torch.randn(rows, K, generator=gen), torch.randn(N, K, generator=gen)
    y = cpu_gemv.cpu_gemv(x, w, threads)
    assert y.shape == (rows, N) and y.dtype == torch.float32
    torch.testing.assert_close(y, _reference(x, w), rtol=1e-5, atol=1e-5 * K ** 0.5)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5 * K ** 0.5)


@needs_kernel
def test_a_row_does_not_depend_on_the_rows_beside_it(monkeypatch):
    """Batched decode gives each request the bits it gets alone (the engine's batch = alone tests rest on this)."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 777, generator=gen), torch.randn(2053, 777, generator=gen)
    together = cpu_gemv.cpu_gemv(x, w)
    for threads in (1, 2):
        for r in range(4):
            assert torch.equal(cpu_gemv.cpu_gemv(x[r:r + 1], w, threads)[0], together[r])
            assert torch.equal(cpu_gemv.cpu_gemv(x[[r, (r + 1) % 4]], w, threads)[0], together[r])
            assert torch.equal(cpu_gemv.cpu_gemv(x[[r, (r + 1) % 4, (r + 2) % 4]], w, threads)[0], together[r])


@needs_kernel
def test_leading_dimensions_and_a_strided_x(monkeypatch):
    monkeypatch.setattr(cpu_gemv, "MIN_WEIGHT", 0)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(40, 96, generator=gen)
    x = torch.randn(2, 1, 192, generator=gen)[..., ::2]  # [2, 1, 96], not contiguous
    assert cpu_gemv.can_run(x, w)
    y = cpu_gemv.linear(x, w, 1)
    assert y.shape == (2, 1, 40)
    torch.testing.assert_close(y, _reference(x.reshape(2, 96), w).view(2, 1, 40), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_products_below_the_size_it_takes_stay_with_f_linear(monkeypatch):
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, 64, generator=gen)
    small, large = torch.randn(cpu_gemv.MIN_WEIGHT // 64 - 1, 64, generator=gen), torch.randn(2048, 64, generator=gen)
    assert not cpu_gemv.can_run(x, small) and cpu_gemv.can_run(x, small, group=2)  # a call of two such weights
    assert cpu_gemv.can_run(x, large)
    assert torch.equal(cpu_gemv.linear(x, small, 1), F.linear(x, small))


def test_linear_falls_back_where_the_kernel_does_not_serve(monkeypatch):
    """More than MAX_ROWS rows, another dtype, an input-major weight, empty tensors, a weight off the CPU or
    the kernel turned off (threads None): F.linear's bits (whatever the size: MIN_WEIGHT 0 here)."""
    monkeypatch.setattr(cpu_gemv, "MIN_WEIGHT", 0)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(24, 40, generator=gen)
    cases = [(torch.randn(5, 40, generator=gen), w),
             (torch.randn(1, 40, generator=gen).double(), w.double()),
             (torch.randn(1, 40, generator=gen), w.t().contiguous().t()),
             (torch.randn(0, 40, generator=gen), w),  # no rows
             (torch.randn(1, 0, generator=gen), torch.randn(24, 0, generator=gen)),  # nothing to sum
             (torch.randn(1, 40, generator=gen), w.to("meta"))]  # a weight off the CPU
    for x, weight in cases:
        assert not cpu_gemv.can_run(x, weight)
        if weight.device.type == "cpu":
            assert torch.equal(cpu_gemv.linear(x, weight, 1), F.linear(x, weight))
    x = torch.randn(1, 40, generator=gen)
    assert torch.equal(cpu_gemv.linear(x, w, None), F.linear(x, w))


@needs_kernel
def test_rows_past_the_limit_are_refused():
    with pytest.raises(ValueError, match="1 to 4 rows"):
        cpu_gemv.cpu_gemv(torch.randn(5, 8), torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"x has 9 columns; the weights must all be contiguous \[N, 8\]"):
        cpu_gemv.cpu_gemv(torch.randn(1, 9), torch.randn(3, 8))
    with pytest.raises(ValueError, match="must all be contiguous"):
        cpu_gemv.cpu_gemv_grouped(torch.randn(1, 8), [torch.randn(3, 8), torch.randn(4, 8)])
    with pytest.raises(ValueError, match="float32 CPU tensors"):
        cpu_gemv.cpu_gemv(torch.randn(1, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="2 inputs for 3 weights"):
        cpu_gemv.cpu_gemv_grouped(torch.randn(2, 1, 8), [torch.randn(3, 8)] * 3)


@needs_kernel
@pytest.mark.parametrize("K,N", [(65, 33), (300, 129), (1024, 511)])
@pytest.mark.parametrize("shared_x", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_gives_each_weight_its_bits_alone(K, N, shared_x, threads, monkeypatch):
    """One call for a token's experts: each weight's rows are the bits cpu_gemv gives it alone, whichever thread
    (the split crosses from one weight to the next) computes them."""
    monkeypatch.setattr(cpu_gemv, "PARALLEL_MIN_WEIGHT", 0)
    gen = torch.Generator().manual_seed(K + N)
    stack = torch.randn(8, N, K, generator=gen)  # an expert stack; the chosen ones are views into it
    chosen = [stack[e] for e in (1, 2, 6)]
    x = torch.randn(2, K, generator=gen) if shared_x else torch.randn(3, 2, K, generator=gen)
    y = cpu_gemv.cpu_gemv_grouped(x, chosen, threads)
    assert y.shape == (3, 2, N)
    for g, w in enumerate(chosen):
        assert torch.equal(y[g], cpu_gemv.cpu_gemv(x if shared_x else x[g], w))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_avx2_build_matches_the_twin(tmp_path):
    """The AVX2 + FMA variant (machines without AVX-512), built here with AVX-512 turned off."""
    out = tmp_path / "gemv_avx2.so"
    flags = ["-O3", "-march=native", "-mno-avx512f", "-fopenmp", "-shared", "-fPIC"]
    done = subprocess.run(["cc", *flags, str(cpu_gemv._SOURCE), "-o", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"no AVX2 build here: {done.stderr[-200:]}")
    lib = ctypes.CDLL(str(out))
    gen = torch.Generator().manual_seed(11)
    for K, N in SHAPES:
        for rows in (1, 4):
            x, w = torch.randn(rows, K, generator=gen), torch.randn(N, K, generator=gen)
            y = torch.empty(rows, N)
            pointers = (ctypes.c_void_p * 1)(w.data_ptr())
            assert lib.gemv_f32(ctypes.c_void_p(x.data_ptr()), ctypes.c_long(0), pointers,
                                ctypes.c_void_p(y.data_ptr()), *map(ctypes.c_long, (1, rows, K, N)), 2) == 0
            torch.testing.assert_close(y, _reference(x, w), rtol=1e-5, atol=1e-5 * K ** 0.5)


@needs_kernel
def test_no_output_rows_is_an_empty_result():
    assert cpu_gemv.cpu_gemv(torch.randn(2, 8), torch.randn(0, 8)).shape == (2, 0)


def test_a_read_only_cache_folder_builds_in_a_temporary_one(tmp_path, monkeypatch):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_gemv, "_cache_dir", lambda: tmp_path / "file" / "below")
    (tmp_path / "file").write_text("not a folder")  # so the cache folder cannot be made
    monkeypatch.setattr(cpu_gemv.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    cpu_gemv._library.cache_clear()
    try:
        if cpu_gemv._library() is None:
            pytest.skip("no AVX2/AVX-512 here")
        assert list((tmp_path / "tmp").glob("deltaserve-kernels-*/cpu_gemv-*.so"))
    finally:
        cpu_gemv._library.cache_clear()


def test_no_compiler_means_no_kernel_and_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_gemv._library.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert not cpu_gemv.available()
        assert "no C compiler" in caplog.text
        x, w = torch.randn(1, 16), torch.randn(8, 16)
        assert torch.equal(cpu_gemv.linear(x, w, 1), F.linear(x, w))
    finally:
        cpu_gemv._library.cache_clear()


def test_another_architecture_is_refused_before_compiling(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_gemv.platform, "machine", lambda: "aarch64")
    with pytest.raises(RuntimeError, match="written for x86-64.*this machine is aarch64"):
        cpu_gemv._build(tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_failing_build_says_what_the_compiler_said(tmp_path, monkeypatch):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'error: this compiler is broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.raises(RuntimeError, match="this compiler is broken"):
        cpu_gemv._build(tmp_path / "cache")
