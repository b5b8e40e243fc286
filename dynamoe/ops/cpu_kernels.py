"""The CPU GEMV extension (``csrc/*.cpp``), built on first use.

For decode-sized batches (1..16 rows) a matmul is bound by reading the weight. Packed weights
(``packed_gemv.cpp``: MXFP4, NVFP4, blockwise FP8) must be decoded in registers: dequantizing into a
buffer first costs 10-30x a bf16 GEMV (docs/benchmarks.md). bf16 weights (``bf16_gemv.cpp``) get
AVX512-BF16 dot products over several weight rows at once, where oneDNN's bf16 GEMV reaches a
third of the read bandwidth on this kind of CPU. The extension is compiled once per machine with the local compiler
(``torch.utils.cpp_extension``, cached under ``TORCH_EXTENSIONS_DIR``) with ``-march=native``; if that
is impossible (no compiler, ``DYNAMOE_NO_CPU_KERNELS=1``) ``load()`` returns None and callers use the
pure-torch dequantize-then-matmul path, which gives the same results. With ``DYNAMOE_REQUIRE_CPU_KERNELS=1``
(``make test`` sets it) a failed build on a CPU the kernels are written for raises instead, with the
compiler's output, so that CI fails rather than skipping every kernel test. Without AVX-512 the kernels take
AVX2 + FMA paths (``csrc/simd_avx2.h``), else scalar loops. ``build()`` compiles the sources with other
flags into another folder (the AVX2 paths: ``march="x86-64-v3"``; the scalar loops: ``"x86-64-v2"``),
leaving the cached build alone.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading


__all__ = ["load", "build", "required", "MAX_ROWS", "prune_stale_builds", "ENV_DISABLE", "ENV_REQUIRE"]

#: set (not "" or "0") to turn the kernels off: load() returns None
ENV_DISABLE = "DYNAMOE_NO_CPU_KERNELS"
#: set to make a failed build raise on a CPU the kernels are written for (x86-64), instead of falling back
ENV_REQUIRE = "DYNAMOE_REQUIRE_CPU_KERNELS"
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")

SOURCES = ("packed_gemv.cpp", "bf16_gemv.cpp", "f32_gemv.cpp", "moe_decode.cpp", "moe_decode_packed.cpp", "rms_norm.cpp", "rope.cpp",
           "router_decode.cpp", "attn_decode.cpp", "moe_block_decode.cpp", "decode_stack.cpp",
           "grouped_gemm_bf16.cpp", "dequantize.cpp")

#: the most rows one fused decode call takes (one accumulator per row in registers); the built module's
#: own MAX_ROWS (csrc/decode_weights.h) must agree -- load() checks
MAX_ROWS = 16
_lock = threading.Lock()
_state: dict = {}
log = logging.getLogger(__name__)


def _csrc_hash(folder: str) -> str:
    """A digest of every source and header (torch's own rebuild check sees only the listed sources,
    not the headers they include); it is part of the extension's name."""
    h = hashlib.sha1()
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            h.update(name.encode() + f.read())
    return h.hexdigest()[:16]


def _cpu_tag(cpuinfo: str = "/proc/cpuinfo") -> str:
    """A digest of what ``-march=native`` compiles for: the CPU's model and instruction-set flags (Linux's
    /proc/cpuinfo; elsewhere what :mod:`platform` says). A library built for a CPU with AMX or AVX-512 dies of an
    illegal instruction on one without, so a home directory (torch's extension cache) shared by machines of
    different kinds -- a cluster's network home -- keeps one build per kind."""
    h = hashlib.sha1(f"{platform.machine()} {platform.processor()}".encode())
    try:
        with open(cpuinfo) as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part"):   # (x86; Arm's names)
                    h.update(line.encode())
                elif not line.strip():   # the first processor's block is enough
                    break
    except OSError:
        pass
    return h.hexdigest()[:8]


def _module_name(here: str) -> str:
    """The extension's name, one per version of the sources and kind of CPU: two dynamoe checkouts (or a running
    process and a newer one) never rebuild each other's library under torch's extension cache, and a machine never
    loads a library built for another's instruction set (:func:`_cpu_tag`)."""
    return f"dynamoe_cpu_kernels_{_csrc_hash(here)}_{_cpu_tag()}"


def _will_build(here: str) -> bool:
    """Whether ``load()`` is going to compile (no build of these sources in torch's extension cache)."""
    try:
        from torch.utils import cpp_extension

        name = _module_name(here)
        folder = cpp_extension._get_build_directory(name, verbose=False)
        return not os.path.exists(os.path.join(folder, f"{name}.so"))
    except Exception:  # noqa: BLE001 -- only decides whether to announce the build
        return True


def _import_built(name: str):
    """The library already built for these sources (the name carries their digest), imported as it
    is; None if that fails. torch's loader would run ninja first, which rebuilds everything when the
    same sources sit at another path (a second checkout), and two checkouts would rebuild each other
    over and over, each build blocking every process that loads the kernels meanwhile."""
    import importlib.machinery
    import importlib.util

    from torch.utils import cpp_extension

    try:
        path = os.path.join(cpp_extension._get_build_directory(name, verbose=False), f"{name}.so")
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except Exception as exc:  # noqa: BLE001 -- e.g. a library still being written: let torch's loader wait for it
        log.info("dynamoe: could not import the built CPU kernels directly (%s); building", exc)
        return None


#: builds of other source versions not loaded for this long are removed after a new build
STALE_BUILD_DAYS = 14


def prune_stale_builds(current: str, root: str, max_age_days: float = STALE_BUILD_DAYS) -> list[str]:
    """Remove ``root``'s ``dynamoe_cpu_kernels_*`` folders other than ``current`` whose files were
    neither written nor read (loading a library reads it) for ``max_age_days``: every source edit
    makes a new build, and old ones (~10 MB each) would pile up in torch's extension cache. A build
    another checkout still loads stays. Returns the removed folders."""
    import shutil
    import time

    removed = []
    limit = time.time() - max_age_days * 86400
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        folder = os.path.join(root, name)
        if not name.startswith("dynamoe_cpu_kernels_") or name == current or not os.path.isdir(folder):
            continue
        try:
            stamps = [os.stat(folder).st_mtime]
            for f in os.listdir(folder):
                st = os.stat(os.path.join(folder, f))
                stamps += [st.st_mtime, st.st_atime]
        except OSError:
            continue
        if max(stamps) < limit:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def cpu_supported() -> bool:
    """Whether this CPU is one the kernels are written and tested for (x86-64; AVX-512 optional)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def required() -> bool:
    """Whether a failed build must raise: ``DYNAMOE_REQUIRE_CPU_KERNELS`` set, the kernels not turned off
    with ``DYNAMOE_NO_CPU_KERNELS``, and a CPU they are written for."""
    return _flag(ENV_REQUIRE) and not _flag(ENV_DISABLE) and cpu_supported()


def _ninja_on_path() -> None:
    """The venv's ninja, when torch looks for it on PATH."""
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def build(build_directory: str, march: str = "native", sources=SOURCES, extra_sources=(), name: str | None = None):
    """Compile ``sources`` (names in ``csrc/``) plus ``extra_sources`` (paths) with ``-march=march`` into
    ``build_directory`` and import the result; torch's cached build that ``load()`` uses is not touched.
    ``march="x86-64-v3"`` (AVX2, no AVX-512) compiles the AVX2 paths, ``"x86-64-v2"`` the scalar loops. Raises on
    a failed build."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    here = os.path.join(os.path.dirname(__file__), "csrc")
    os.makedirs(build_directory, exist_ok=True)
    name = name or f"dynamoe_cpu_kernels_{march.replace('-', '_')}_{_csrc_hash(here)}"
    return cpp_extension.load(
        name=name, sources=[os.path.join(here, f) for f in sources] + list(extra_sources),
        extra_cflags=[*CFLAGS, f"-march={march}", f"-I{here}"], extra_ldflags=["-fopenmp"],
        build_directory=build_directory, verbose=False,
    )


def load():
    """The compiled module, or None when it cannot be built here (reason logged once). The first call on
    a machine compiles it (a minute or two, announced on stderr). When ``required()``, a failed build
    raises RuntimeError with the compiler's output instead (on every call, without building again)."""
    if "error" in _state:
        raise _state["error"]
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "error" in _state:
            raise _state["error"]
        if "module" in _state:
            return _state["module"]
        module = None
        if _flag(ENV_DISABLE):
            log.info("dynamoe CPU kernels disabled by %s", ENV_DISABLE)
        else:
            try:
                from torch.utils import cpp_extension

                _ninja_on_path()
                here = os.path.join(os.path.dirname(__file__), "csrc")
                building = _will_build(here)
                name = _module_name(here)
                module = None if building else _import_built(name)
                if module is None:
                    if building:
                        print("dynamoe: compiling the CPU kernels (dynamoe/ops/csrc) for this machine, once; a "
                              "minute or two ...", file=sys.stderr, flush=True)
                    module = cpp_extension.load(
                        name=name, sources=[os.path.join(here, f) for f in SOURCES],
                        extra_cflags=[*CFLAGS, "-march=native"],
                        extra_ldflags=["-fopenmp"], verbose=False,
                    )
                if getattr(module, "MAX_ROWS", MAX_ROWS) != MAX_ROWS:
                    raise RuntimeError(f"the kernels' MAX_ROWS {module.MAX_ROWS} differs from cpu_kernels.MAX_ROWS {MAX_ROWS}")
                if building:
                    root = os.path.dirname(cpp_extension._get_build_directory(name, verbose=False))
                    for folder in prune_stale_builds(name, root):
                        log.info("dynamoe: removed the stale CPU kernel build %s", folder)
            except Exception as exc:  # noqa: BLE001 -- any build failure means: use the fallback
                if required():
                    _state["error"] = RuntimeError(
                        f"dynamoe: the CPU kernels failed to build on this x86-64 machine and {ENV_REQUIRE} is set "
                        f"({ENV_DISABLE}=1 turns them off deliberately): {exc}")
                    raise _state["error"] from exc
                log.warning("dynamoe: CPU GEMV kernels unavailable (%s); using torch matmuls (dequantize-then-matmul for packed weights)", exc)
                module = None
        _state["module"] = module
        return module
