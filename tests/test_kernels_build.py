"""Build checks of the framework-agnostic kernels (csrc/kernels) outside of setup.py.

Why: the kernels promise to build without torch (CMake + ctest), and the CUDA sources must stay
compilable on machines without a GPU, where nothing else would notice them breaking.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "csrc" / "kernels"
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")

# The flags torch.utils.cpp_extension gives nvcc, so a kernel that builds here builds in setup.py.
TORCH_NVCC_FLAGS = [
    "-std=c++20",
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]


def run(cmd: list[str], cwd: Path | None = None) -> str:
    """Run a command; on failure, fail the test with its output."""
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} exited with {done.returncode}:\n{output[-6000:]}"
    return output


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not found")
def test_cmake_build_and_ctest(tmp_path: Path) -> None:
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = run(["cmake", "-S", str(ROOT), "-B", str(tmp_path), *generator])
    assert "tawpipe kernels:" in configure
    run(["cmake", "--build", str(tmp_path), "-j", "2"])
    out = run(["ctest", "--test-dir", str(tmp_path), "--output-on-failure"])
    assert "100% tests passed" in out
    # Without nvcc the CUDA part must be skipped, not fail the configure.
    assert ("CUDA=ON" in configure) == (NVCC is not None)


@needs_nvcc
@pytest.mark.parametrize("source", sorted(KERNELS.glob("*.cu")), ids=lambda p: p.name)
def test_nvcc_compiles_kernel(source: Path, tmp_path: Path) -> None:
    run([NVCC, "-c", "-O3", *TORCH_NVCC_FLAGS, "-gencode", "arch=compute_80,code=sm_80",
         "-Xcompiler", "-Wall,-Wextra,-Werror", "-Werror", "all-warnings",
         "-I", str(KERNELS), str(source), "-o", str(tmp_path / "kernel.o")])


@needs_nvcc
def test_cuda_binding_compiles(tmp_path: Path) -> None:
    """csrc/torch/ops_cuda.cpp needs no CUDA headers, so any torch install can syntax-check it."""
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in [*include_paths(), str(ROOT / "csrc"), sysconfig.get_paths()["include"]]]
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    run([cxx, "-fsyntax-only", "-std=c++20", *includes, str(ROOT / "csrc" / "torch" / "ops_cuda.cpp")])


@needs_nvcc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="host emulation is set up for Linux")
def test_cuda_kernel_logic_in_host_emulation(tmp_path: Path) -> None:
    """Run the CUDA kernel's indexing, tiling and vector paths on the CPU, thread by thread,
    through the same C++ test program as ctest (every dtype pair, copy and accumulate)."""
    source = (KERNELS / "shard_ops_cuda.cu").read_text()
    emulated, launches = re.subn(
        r"(\w+(?:<\w+>)?)<<<([^,]+),\s*([^,]+),[^>]*>>>\(\s*", r"emulated_launch(\1, \2, \3, ", source
    )
    assert launches >= 1, "no kernel launch found to emulate"
    kernel = tmp_path / "shard_ops_cuda_emulated.cpp"
    kernel.write_text(emulated)
    binary = tmp_path / "emulated_test"
    run([NVCC, "-x", "c++", "-std=c++17", "-O1", "-Xcompiler", "-fopenmp",
         "-include", str(KERNELS / "tests" / "cuda_host_emulation.h"),
         "-DTAWPIPE_KERNELS_CUDA=1", "-I", str(KERNELS),
         str(kernel), str(KERNELS / "shard_ops_cpu.cpp"), str(KERNELS / "tests" / "shard_ops_test.cpp"),
         "-o", str(binary)])
    out = run([str(binary)])
    assert "all shard kernel checks passed" in out
    assert "CPU kernels only" not in out  # the emulated CUDA path really ran
