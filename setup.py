"""Builds tawpipe._C, the native ops (metadata lives in pyproject.toml).

The CPU kernels always build. The CUDA kernels build when torch is a CUDA build and nvcc is
found; TAWPIPE_BUILD_CUDA=0 skips them, TAWPIPE_BUILD_CUDA=1 makes their absence an error. With no
GPU visible (a build node) and TORCH_CUDA_ARCH_LIST unset, they are built for the architectures
in DEFAULT_CUDA_ARCHS that nvcc supports. The installed package requires the torch version it
was compiled against.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).resolve().parent

CPU_SOURCES = [
    "csrc/kernels/shard_ops_cpu.cpp",
    "csrc/torch/segments.cpp",
    "csrc/torch/inplace.cpp",
    "csrc/torch/ops.cpp",
    "csrc/torch/bound.cpp",
    "csrc/torch/module.cpp",
]
CUDA_SOURCES = ["csrc/kernels/shard_ops_cuda.cu", "csrc/torch/ops_cuda.cpp"]
# The prefetcher behind tawpipe.engine.offload: its host path always, its CUDA path with the CUDA kernels.
CPU_SOURCES += ["csrc/kernels/prefetch.cpp", "csrc/torch/prefetch.cpp"]
CUDA_SOURCES += ["csrc/kernels/prefetch_cuda.cu"]


def build_cuda() -> bool:
    """Whether to compile the CUDA kernels, from TAWPIPE_BUILD_CUDA and what is installed."""
    flag = os.environ.get("TAWPIPE_BUILD_CUDA", "").strip()
    if flag not in ("", "0", "1"):
        raise ValueError(f"TAWPIPE_BUILD_CUDA must be 0 or 1, got {flag!r}")
    possible = torch.version.cuda is not None and CUDA_HOME is not None
    if flag == "1" and not possible:
        raise RuntimeError(
            "TAWPIPE_BUILD_CUDA=1 but the CUDA kernels cannot be built: "
            f"torch.version.cuda={torch.version.cuda!r}, CUDA_HOME={CUDA_HOME!r}. "
            "Install a CUDA build of torch and the CUDA toolkit (nvcc), or unset TAWPIPE_BUILD_CUDA."
        )
    return flag != "0" and possible


# GPU architectures for a build that cannot ask a GPU: Turing to Blackwell, the newest also as PTX.
DEFAULT_CUDA_ARCHS = ("7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0")


def cuda_arch_list() -> str | None:
    """TORCH_CUDA_ARCH_LIST for a CUDA build on a machine without a visible GPU, where torch would
    find no architecture and fail; None where the user set it or a GPU can be asked."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.device_count() > 0:
        return None
    listed = subprocess.run([str(Path(CUDA_HOME, "bin", "nvcc")), "--list-gpu-arch"], capture_output=True,
                            text=True).stdout
    supported = {f"{m[:-1]}.{m[-1]}" for m in re.findall(r"compute_(\d+)", listed)}
    archs = [a for a in DEFAULT_CUDA_ARCHS if a in supported] or ["8.0"]
    return ";".join([*archs[:-1], archs[-1] + "+PTX"])


def compiles(flags: list[str], source: str) -> bool:
    """Whether the C++ compiler builds and links source with flags."""
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.cpp"
        probe.write_text(source)
        try:
            done = subprocess.run(
                [cxx, *flags, str(probe), "-o", str(Path(tmp) / "probe")], capture_output=True
            )
        except OSError:
            return False
    return done.returncode == 0


def openmp_flags() -> list[str]:
    """["-fopenmp"] if the C++ compiler builds and links OpenMP code, else [] (CPU kernels then
    run on one thread)."""
    source = "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
    return ["-fopenmp"] if compiles(["-fopenmp"], source) else []


def masked_epilogue_flags() -> list[str]:
    """GCC's masked (AVX-512) loop epilogues where the compiler takes them: the CPU kernels run
    thousands of short cast loops per call, whose scalar remainders would otherwise dominate."""
    flag = "--param=vect-partial-vector-usage=1"
    return [flag] if compiles([flag], "int main() { return 0; }\n") else []


def extension() -> CppExtension:
    omp = openmp_flags()
    # -fno-trapping-math lets the compiler vectorise the branch-free dtype conversions (it may
    # then compute both sides of a select); the kernels never read floating-point exception flags.
    # -ffp-contract=off: no fused multiply-add in any CPU clone (csrc/kernels), so accumulation
    # rounds the same on every CPU.
    cxx = ["-O3", "-fno-trapping-math", "-ffp-contract=off", *masked_epilogue_flags(), *omp]
    common = {
        "name": "tawpipe._C",
        "include_dirs": [str(ROOT / "csrc")],
        "extra_link_args": omp,
    }
    if build_cuda():
        archs = cuda_arch_list()
        if archs:
            print(f"tawpipe: no GPU visible, building the CUDA kernels for TORCH_CUDA_ARCH_LIST={archs}")
            os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        return CUDAExtension(
            sources=CPU_SOURCES + CUDA_SOURCES,
            define_macros=[("TAWPIPE_TORCH_CUDA", None)],  # csrc/torch/bound.cpp binds CUDA tensors
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
            **common,
        )
    return CppExtension(sources=CPU_SOURCES, extra_compile_args={"cxx": cxx}, **common)


def nccl_home() -> Path | None:
    """The NCCL to build tawpipe._nccl against: $TAWPIPE_NCCL_HOME, else the nvidia-nccl wheel
    that CUDA builds of torch install (so the extension and torch load one libnccl.so.2)."""
    candidates = [Path(os.environ["TAWPIPE_NCCL_HOME"])] if os.environ.get("TAWPIPE_NCCL_HOME") else []
    try:
        import nvidia.nccl  # a namespace package of the nvidia-nccl-cu* wheels

        candidates += [Path(p) for p in nvidia.nccl.__path__]
    except ImportError:
        pass
    for home in candidates:
        if (home / "include" / "nccl.h").is_file() and (home / "lib" / "libnccl.so.2").exists():
            return home
    return None


def nccl_extensions() -> list[CUDAExtension]:
    """tawpipe._nccl (the native NCCL backend) where the CUDA kernels build and NCCL is found;
    TAWPIPE_BUILD_NCCL=0 skips it, TAWPIPE_BUILD_NCCL=1 makes its absence an error."""
    flag = os.environ.get("TAWPIPE_BUILD_NCCL", "").strip()
    if flag not in ("", "0", "1"):
        raise ValueError(f"TAWPIPE_BUILD_NCCL must be 0 or 1, got {flag!r}")
    home = nccl_home() if flag != "0" else None
    if flag == "0" or home is None or not build_cuda():
        if flag == "1":
            raise RuntimeError(
                "TAWPIPE_BUILD_NCCL=1 but tawpipe._nccl cannot be built: it needs the CUDA kernels "
                f"(buildable: {build_cuda()}) and NCCL (nccl.h and libnccl.so.2: found {home}); install "
                "the nvidia-nccl-cu* wheel matching torch, or set TAWPIPE_NCCL_HOME"
            )
        return []
    lib = home / "lib"
    return [
        CUDAExtension(
            name="tawpipe._nccl",
            sources=["csrc/kernels/nccl_group.cpp", "csrc/torch/nccl_module.cpp"],
            include_dirs=[str(ROOT / "csrc"), str(home / "include")],
            library_dirs=[str(lib)],
            # By exact SONAME, found through the wheel (here or next to an installed tawpipe): the
            # dynamic loader then reuses the libnccl.so.2 torch has already loaded.
            extra_link_args=["-l:libnccl.so.2", f"-Wl,-rpath,{lib}", "-Wl,-rpath,$ORIGIN/../nvidia/nccl/lib"],
            extra_compile_args={"cxx": ["-O2"]},
        )
    ]


setup(
    ext_modules=[extension(), *nccl_extensions()],
    cmdclass={"build_ext": BuildExtension},
    install_requires=[f"torch=={torch.__version__.split('+')[0]}", "numpy", "tqdm"],
)
