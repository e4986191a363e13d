"""radixrt's C++ CPU kernels (`csrc/*.cpp`): built for this machine, cached, loaded once.

The sources are compiled with `torch.utils.cpp_extension` into one shared library that registers
`torch.ops.radixrt.*`: decode attention (`csrc/paged_decode.cpp`) and its per-step plan
(`csrc/decode_plan.cpp`), a CPU decode batch's index tensors (`csrc/decode_batch.cpp`, used by
`ForwardBatch.build`), extend (prefill) attention (`csrc/extend_attention.cpp`), the
quantized small-M matmul (`csrc/qgemv.cpp`), the int8-activation VNNI quantized matmul
(`csrc/qgemm_vnni.cpp`, AVX512-VNNI or AVX2 CPUs), the bf16 linear on AMX tiles
(`csrc/amx_linear.cpp`, AMX-BF16 CPUs), the fused layer ops (`csrc/fused_ops.cpp`), the
decode step's layer loop over them (`csrc/decode_layers.cpp`, its thread team in
`csrc/team.h`), greedy sampling's row-wise argmax (`csrc/argmax.cpp`), the sampled rows' filter and draw
(`csrc/sample.cpp`) and what benchmarks
record about two threads, their round trip and compute scaling (`csrc/cpu_probe.cpp`);
`csrc/*.h` are their shared headers. The instruction set
is chosen from this CPU's flags at build time (AVX-512 F/BW/VL/DQ, else AVX2 + FMA + F16C, else
the compiler's baseline; never `-march=native`), and the library is cached under
`<cache root>/<key>/` where `key` hashes the sources and headers, the torch version, the chosen ISA and the
CPU's whole flag set: another CPU or another torch rebuilds, the same machine builds once.

- `make setup` builds it (`python -m radixrt.attention.cpu_kernels build`); otherwise the first
  `load_cpu_kernels()` builds it, under a file lock (several processes may start at once).
- A failed build (no compiler, no ninja, compile error) logs one warning, leaves `failed.log`
  in the cache directory so later processes do not retry, and `load_cpu_kernels()` returns
  False: callers fall back to their torch path. `build` retries and prints the error.

Cache root: `$RADIXRT_KERNEL_CACHE`, else `<venv>/radixrt-kernels` inside a virtual environment,
else `~/.cache/radixrt/kernels`. `RADIXRT_CPU_ISA=avx2|default` builds a lower instruction set
than the CPU offers (to test those paths); `RADIXRT_KERNEL_OPT=-O0|-O1|-O2|-O3` (default -O3)
sets the optimisation level: the tests build the lower instruction sets at -O1, checking that they
agree, not their speed (the generic build's paged decode compiles in 70 s at -O3, 39 at -O1 on a
slow 2-core machine). `RADIXRT_DISABLE_CPU_KERNELS=1` never loads them.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES: tuple[str, ...] = ("paged_decode.cpp", "qgemv.cpp", "qgemm_vnni.cpp", "fused_ops.cpp",
                           "amx_linear.cpp", "extend_attention.cpp", "decode_layers.cpp", "argmax.cpp",
                           "decode_plan.cpp", "decode_batch.cpp", "cpu_probe.cpp", "sample.cpp")
LIB_NAME = "radixrt_cpu_kernels"
ISAS: tuple[str, ...] = ("avx512", "avx2", "default")  # best first

# Compiler flags per instruction set; CPU_CAPABILITY selects at::vec's implementation (the same
# names torch's own kernels are compiled under).
_ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma",
               "-mf16c", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"),
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"),
    "default": ("-DCPU_CAPABILITY=DEFAULT",),
}
_ISA_NEEDS: dict[str, frozenset[str]] = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "default": frozenset(),
}
# Extra flags an instruction set adds when the CPU has the named flag (sources guard their use
# with the matching #ifdef, e.g. __AVX512BF16__).
_ISA_OPTIONAL: dict[str, tuple[tuple[str, str], ...]] = {
    "avx512": (("avx512_bf16", "-mavx512bf16"), ("avx512_vnni", "-mavx512vnni"),
               ("amx_tile", "-mamx-tile"), ("amx_bf16", "-mamx-bf16")),
}
_COMMON_FLAGS: tuple[str, ...] = ("-fopenmp",)
OPT_LEVELS: tuple[str, ...] = ("-O3", "-O2", "-O1", "-O0")  # the first is the default


def opt_level() -> str:
    """The optimisation level from `$RADIXRT_KERNEL_OPT` (part of the cache key via cflags)."""
    level = os.environ.get("RADIXRT_KERNEL_OPT") or OPT_LEVELS[0]
    if level not in OPT_LEVELS:
        raise ValueError(f"RADIXRT_KERNEL_OPT must be one of {OPT_LEVELS}, got {level!r}")
    return level


def headers() -> tuple[str, ...]:
    """The shared headers the sources include (`csrc/*.h`): part of the cache key, so that
    editing one rebuilds."""
    return tuple(sorted(p.name for p in SOURCE_DIR.glob("*.h")))


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def choose_isa(flags: frozenset[str] | None = None, requested: str | None = None) -> str:
    """Best instruction set this CPU has (x86 only; other machines build `default`).
    `requested` (or `$RADIXRT_CPU_ISA`) may lower it, never raise it."""
    flags = cpu_flags() if flags is None else flags
    requested = requested or os.environ.get("RADIXRT_CPU_ISA") or None
    if requested is not None and requested not in ISAS:
        raise ValueError(f"RADIXRT_CPU_ISA must be one of {ISAS}, got {requested!r}")
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    start = ISAS.index(requested) if requested else 0
    for isa in ISAS[start:]:
        if isa == "default" or (x86 and _ISA_NEEDS[isa] <= flags):
            return isa
    return "default"


@dataclass(frozen=True)
class BuildSpec:
    isa: str
    cflags: tuple[str, ...]
    key: str
    directory: Path

    @property
    def name(self) -> str:
        return f"{LIB_NAME}_{self.key}"

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"

    @property
    def ok_marker(self) -> Path:
        return self.directory / "built.ok"

    @property
    def failed_log(self) -> Path:
        return self.directory / "failed.log"


def cache_root() -> Path:
    env = os.environ.get("RADIXRT_KERNEL_CACHE")
    if env:
        return Path(env)
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        return Path(sys.prefix) / "radixrt-kernels"
    return Path.home() / ".cache" / "radixrt" / "kernels"


def build_spec(isa: str | None = None) -> BuildSpec:
    """What would be built here, and where: the key covers sources, torch, flags and the CPU."""
    flags = cpu_flags()
    isa = choose_isa(flags, isa)
    optional = tuple(f for need, f in _ISA_OPTIONAL.get(isa, ()) if need in flags)
    cflags = (opt_level(), *_COMMON_FLAGS, *_ISA_FLAGS[isa], *optional)
    h = hashlib.sha256()
    for src in (*SOURCES, *headers()):
        h.update(src.encode())
        h.update((SOURCE_DIR / src).read_bytes())
    for part in (torch.__version__, platform.machine(), isa, " ".join(cflags),
                 " ".join(sorted(flags))):
        h.update(b"\0" + part.encode())
    key = h.hexdigest()[:16]
    return BuildSpec(isa, cflags, key, cache_root() / f"{isa}-{key}")


_lock = threading.Lock()
_loaded: BuildSpec | None = None
_failed: str | None = None  # why the kernels are unavailable in this process


def _register_fakes() -> None:
    """Shape-only implementations, so tracing (torch.compile, meta tensors) sees the ops."""

    @torch.library.register_fake("radixrt::paged_decode")
    def _(q, k_buffer, v_buffer, kv_indices, row_start, row_len, group_start, group_len,
          group_row_ptr, group_rows, scale):
        return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)

    @torch.library.register_fake("radixrt::paged_decode_i8")
    def _(q, k_buffer, v_buffer, k_scale, v_scale, kv_indices, row_start, row_len, group_start,
          group_len, group_row_ptr, group_rows, scale):
        return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)

    @torch.library.register_fake("radixrt::extend_attention")
    def _(q, k_buffer, v_buffer, kv_indices, kv_indptr, loc, qo_indptr, scale):
        return torch.empty_like(q)

    @torch.library.register_fake("radixrt::qgemv")
    def _(x, codes, scale, offset, bits):
        return x.new_empty(x.shape[0], codes.shape[0] * 16)

    @torch.library.register_fake("radixrt::qgemv_argmax")
    def _(x, codes, scale, offset, bits):
        return (x.new_empty(x.shape[0], codes.shape[0] * 16),
                x.new_empty(x.shape[0], dtype=torch.int64))

    @torch.library.register_fake("radixrt::qgemm_vnni")
    def _(x, packed, bits, terms=1):
        return x.new_empty(x.shape[0], packed.shape[0] * 16)

    @torch.library.register_fake("radixrt::qgemm_vnni_f32")
    def _(x, packed, bits, terms=1):
        return x.new_empty(x.shape[0], packed.shape[0] * 16, dtype=torch.float32)

    @torch.library.register_fake("radixrt::qgemm_vnni_f32_argmax")
    def _(x, packed, bits, terms=1):
        return (x.new_empty(x.shape[0], packed.shape[0] * 16, dtype=torch.float32),
                x.new_empty(x.shape[0], dtype=torch.int64))

    @torch.library.register_fake("radixrt::amx_linear_argmax")
    def _(x, packed, bias):
        return x.new_empty(x.shape[0], dtype=torch.int64)

    @torch.library.register_fake("radixrt::rms_norm")
    def _(x, weight, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake("radixrt::add_rms_norm")
    def _(x, residual, weight, eps):
        return x.new_empty(x.shape), x.new_empty(x.shape)

    @torch.library.register_fake("radixrt::add_rms_norm_")
    def _(x, residual, weight, eps):
        return None

    @torch.library.register_fake("radixrt::silu_mul")
    def _(gate_up):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake("radixrt::rope_qk")
    def _(qkv, cos, sin, num_q_heads, num_kv_heads):
        n, d = qkv.shape[0], cos.shape[1]
        return qkv.new_empty(n, num_q_heads, d), qkv.new_empty(n, num_kv_heads, d)

    @torch.library.register_fake("radixrt::kv_store")
    def _(k_buffer, v_buffer, loc, k, v):
        return None

    @torch.library.register_fake("radixrt::kv_read_i8")
    def _(k_buffer, v_buffer, k_scale, v_scale, slots, dtype):
        shape = (slots.shape[0], *k_buffer.shape[1:])
        return k_buffer.new_empty(shape, dtype=dtype), k_buffer.new_empty(shape, dtype=dtype)

    @torch.library.register_fake("radixrt::kv_store_i8")
    def _(k_buffer, v_buffer, k_scale, v_scale, loc, k, v):
        return None


PCH_HEADER = "torch_headers.h"  # the torch headers each source includes first (csrc/)


def _pch_command(spec: BuildSpec, out: Path) -> list[str]:
    """The compiler call that precompiles `csrc/torch_headers.h` into `out` with the macros,
    language, target and optimisation flags `cpp_extension.load` gives every source (GCC uses a
    precompiled header only under the same ones; tests compare this list with the generated
    build.ninja). Include paths do not have to match."""
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths("cpu"),
                sysconfig.get_path("include", scheme="posix_prefix")]
    return [os.environ.get("CXX", "c++"), "-x", "c++-header",
            f"-DTORCH_EXTENSION_NAME={spec.name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            *(f for path in includes for f in ("-isystem", path)), "-fPIC", "-std=c++20",
            *spec.cflags, str(SOURCE_DIR / PCH_HEADER), "-o", str(out)]


def _precompile_headers(spec: BuildSpec) -> Path | None:
    """Precompiles the shared torch headers into `<build>/pch/` and returns that directory (put
    first on the include path, where GCC finds the `.gch` before the header in `csrc/`); None,
    with a log line, where it fails: the build then parses the headers in every source (same
    objects, ~13 s more per source). Ten of the eleven sources use it: ~2 CPU-minutes saved per
    build on a 2-core Zen 1, for one ~20-30 s precompile."""
    pch_dir = spec.directory / "pch"
    pch_dir.mkdir(parents=True, exist_ok=True)
    try:
        res = subprocess.run(_pch_command(spec, pch_dir / f"{PCH_HEADER}.gch"),
                             capture_output=True, text=True, timeout=600)
        why = res.stderr[-500:] if res.returncode != 0 else None
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    if why is None:
        return pch_dir
    logger.info("not precompiling the torch headers: %s", why)
    shutil.rmtree(pch_dir, ignore_errors=True)  # no partial .gch for the sources to find
    return None


def _compile(spec: BuildSpec, verbose: bool) -> None:
    from torch.utils import cpp_extension

    spec.directory.mkdir(parents=True, exist_ok=True)
    env_path = os.environ.get("PATH", "")
    extra = [str(Path(sys.executable).parent)]  # ninja / c++ from the venv, if any
    try:
        import ninja  # type: ignore[import-not-found]

        extra.insert(0, ninja.BIN_DIR)
    except ImportError:
        pass
    os.environ["PATH"] = os.pathsep.join([*extra, env_path])
    pch_dir = None
    try:
        pch_dir = _precompile_headers(spec)
        cpp_extension.load(
            name=spec.name,
            sources=[str(SOURCE_DIR / s) for s in SOURCES],
            extra_cflags=[*spec.cflags, "-Winvalid-pch"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[*([str(pch_dir)] if pch_dir else []), str(SOURCE_DIR)],
            build_directory=str(spec.directory),
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        os.environ["PATH"] = env_path
        if pch_dir is not None:  # ~0.4 GB, needed only while the sources compile
            shutil.rmtree(pch_dir, ignore_errors=True)


def _build_and_load(spec: BuildSpec, force: bool, verbose: bool) -> None:
    """Builds (under the directory's file lock) unless built, then loads. Raises on failure."""
    spec.directory.mkdir(parents=True, exist_ok=True)
    if spec.ok_marker.exists() and spec.library.exists() and not force:
        torch.ops.load_library(str(spec.library))
        return
    with open(spec.directory / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if spec.ok_marker.exists() and spec.library.exists() and not force:
            torch.ops.load_library(str(spec.library))
            return
        if spec.failed_log.exists() and not force:
            raise RuntimeError(f"an earlier build failed (see {spec.failed_log})")
        # torch's cpp_extension marks a build in progress with a `lock` file that a build
        # killed mid-way leaves behind, and the next build would wait on it forever. Under our
        # flock no other build of this key runs, so one found here is stale.
        stale = spec.directory / "lock"
        if stale.exists():
            logger.warning("removing a stale build lock left by a killed build: %s", stale)
            stale.unlink(missing_ok=True)
        t0 = time.perf_counter()
        try:
            _compile(spec, verbose)
        except Exception as e:  # noqa: BLE001 - any build error means "fall back"
            spec.failed_log.write_text(f"{type(e).__name__}: {e}\n")
            raise
        spec.failed_log.unlink(missing_ok=True)
        spec.ok_marker.write_text(f"{spec.isa} {torch.__version__}\n")
        logger.info("built CPU kernels (%s) in %.1f s: %s", spec.isa,
                    time.perf_counter() - t0, spec.library)


def load_cpu_kernels(build: bool = True) -> bool:
    """True once `torch.ops.radixrt.*` are usable in this process. Builds if needed (and
    `build`); on failure warns once and returns False from then on."""
    global _loaded, _failed
    if _loaded is not None:
        return True
    if _failed is not None:
        return False
    with _lock:
        if _loaded is not None:
            return True
        if _failed is not None:
            return False
        if os.environ.get("RADIXRT_DISABLE_CPU_KERNELS", "") not in ("", "0"):
            _failed = "RADIXRT_DISABLE_CPU_KERNELS is set"
            return False
        try:
            spec = build_spec()
            if not build and not spec.ok_marker.exists():
                _failed = "not built"
                return False
            _build_and_load(spec, force=False, verbose=False)
            _register_fakes()
        except Exception as e:  # noqa: BLE001 - never crash: the torch path still works
            _failed = f"{type(e).__name__}: {e}"
            logger.warning("radixrt CPU kernels unavailable, using the torch fallback (%s); "
                           "`python -m radixrt.attention.cpu_kernels build` retries and shows "
                           "the error", _failed.splitlines()[0][:300])
            return False
        _loaded = spec
        return True


def unavailable_reason() -> str | None:
    """Why `load_cpu_kernels()` returned False (None when loaded or not tried)."""
    return _failed


def op_unavailable_reason(op: str, dtypes: tuple[torch.dtype, ...], dtype: torch.dtype,
                          head_dim: int, build: bool = True) -> str | None:
    """None when `torch.ops.radixrt.<op>` can run on a CPU pool of this dtype and head_dim
    (building the library if needed and `build`), else why not. The op lists its head dims
    through `<op>_head_dims`."""
    if dtype not in dtypes:
        return f"dtype {dtype} not supported"
    if not load_cpu_kernels(build=build):
        return f"CPU kernels unavailable ({unavailable_reason()})"
    if not hasattr(torch.ops.radixrt, op):
        return f"the loaded CPU kernel library has no {op} op"
    dims = getattr(torch.ops.radixrt, f"{op}_head_dims")()
    if head_dim not in dims:
        return f"head_dim {head_dim} not in {list(dims)}"
    return None


def loaded_spec() -> BuildSpec | None:
    return _loaded


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixrt.attention.cpu_kernels",
                                 description="Build / inspect radixrt's C++ CPU kernels.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build for this machine (retries a failed build)")
    b.add_argument("--isa", choices=ISAS, default=None, help="lower the instruction set")
    b.add_argument("--verbose", action="store_true")
    sub.add_parser("info", help="print the cache key, directory and state")
    sub.add_parser("clean", help="remove every cached build")
    args = ap.parse_args(argv)
    if args.cmd == "clean":
        shutil.rmtree(cache_root(), ignore_errors=True)
        print(f"removed {cache_root()}")
        return 0
    spec = build_spec(getattr(args, "isa", None))
    if args.cmd == "info":
        state = ("built" if spec.ok_marker.exists() else
                 "failed" if spec.failed_log.exists() else "not built")
        print(f"isa={spec.isa} key={spec.key} state={state}\ndirectory={spec.directory}")
        return 0
    try:
        _build_and_load(spec, force=True, verbose=args.verbose)
    except Exception as e:  # noqa: BLE001
        print(f"radixrt CPU kernels: build failed ({type(e).__name__}: {e}); the runtime will "
              "use its torch fallback", file=sys.stderr)
        return 1
    print(f"radixrt CPU kernels ({spec.isa}, "
          f"{torch.ops.radixrt.paged_decode_isa()}): {spec.library}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
