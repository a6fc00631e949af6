"""Compile a C kernel of this package once per machine and load it with ctypes.

The shared object is cached under `$ASYNCPP_KERNEL_CACHE` (default
`~/.cache/asyncpp/kernels`), named by a hash of the source and the package's
headers, the compiler and the flags. It is built for one ISA level
(`asyncpp.kernels.isa`: `generic`, `avx2`, `avx512`, `avx512_bf16`), whose
flags are part of the key, so forcing a lower level on a machine that runs a
higher one loads another library, never the native one. Writers
race safely: each compiles to a private temporary file and renames it into
place. OpenMP comes from the `libgomp.so.1` that torch has already loaded, so
kernels and torch share one thread pool.

`load_kernel_library` returns None, after one warning, when there is no
compiler or the build fails: callers fall back to plain torch code.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch

from asyncpp.kernels.isa import compile_flags, cpu_info
from asyncpp.logging import get_logger

_BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")
DISABLE_ENV = "ASYNCPP_DISABLE_KERNELS"
# The dtype codes kernels that take float32 or bfloat16 rows expect: the DTYPE_* enum in cpu_vec.h.
VEC_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def kernel_cache_dir() -> Path:
    return Path(os.environ.get("ASYNCPP_KERNEL_CACHE", Path.home() / ".cache" / "asyncpp" / "kernels"))


@functools.cache
def load_kernel_library(name: str, isa: str) -> ctypes.CDLL | None:
    """Load `asyncpp/kernels/<name>.c` built for ISA level `isa`, compiling it on first use."""
    log = get_logger(role="kernels", kernel=name, isa=isa)
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        log.info("kernel_disabled", env=DISABLE_ENV)
        return None
    compiler = find_compiler()
    if compiler is None:
        log.warning("kernel_unavailable", reason="no C compiler (cc/gcc) on PATH; using the torch fallback")
        return None
    source = resources.files("asyncpp.kernels").joinpath(f"{name}.c").read_bytes()
    headers = _headers()
    flags = _BASE_FLAGS + compile_flags(isa)
    try:
        target = kernel_cache_dir() / f"{name}-{isa}-{_build_key(compiler, flags, source, headers)}.so"
        if not target.exists():
            _compile(compiler, flags, source, headers, target)
            log.info("kernel_compiled", path=str(target))
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        log.warning("kernel_unavailable", reason=f"build failed: {detail.strip()[:500]}; using the torch fallback")
        return None


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_source(source: bytes, isa: str, target: Path, headers: dict[str, bytes] | None = None) -> None:
    """Build a kernel's C `source` (another version of one, for a benchmark) for level `isa` into `target`,
    as `load_kernel_library` builds the package's: the same flags, `headers` (name -> text; default the
    package's) beside it."""
    compiler = find_compiler()
    if compiler is None:
        raise OSError("no C compiler (cc/gcc) on PATH")
    _compile(compiler, _BASE_FLAGS + compile_flags(isa), source, _headers() if headers is None else headers, target)


def compile_checkout(tree: Path, name: str, isa: str, target: Path) -> None:
    """Build kernel `name` of another checkout of asyncpp at `tree` (its `asyncpp/kernels/<name>.c` and the
    headers beside it) for level `isa` into `target`: the benchmarks' A/B of two versions."""
    kernels = tree / "asyncpp" / "kernels"
    headers = {h.name: h.read_bytes() for h in kernels.glob("*.h")}
    compile_source((kernels / f"{name}.c").read_bytes(), isa, target, headers)


def _headers() -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in resources.files("asyncpp.kernels").iterdir() if f.name.endswith(".h")}


def _build_key(compiler: str, flags: tuple[str, ...], source: bytes, headers: dict[str, bytes]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(source)
    for header_name in sorted(headers):
        digest.update(header_name.encode() + headers[header_name])
    # -mtune=native schedules for this CPU, so its flags are part of the key too.
    for part in (version, " ".join(flags), platform.machine(), " ".join(sorted(cpu_info().flags))):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _compile(compiler: str, flags: tuple[str, ...], source: bytes, headers: dict[str, bytes], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "kernel.c"
        src.write_bytes(source)
        for header_name, text in headers.items():  # `#include "x.h"` resolves beside the source
            (Path(tmp) / header_name).write_bytes(text)
        out = Path(tmp) / "kernel.so"
        subprocess.run([compiler, *flags, str(src), "-o", str(out), "-lm"], capture_output=True, text=True, check=True)
        os.replace(out, target)
