"""cpu_kernels.load() under its switches: DYNAMOE_REQUIRE_CPU_KERNELS makes a failed build raise with the
compiler's output (what `make test` relies on to fail instead of skipping), without it the library falls
back with one warning, and DYNAMOE_NO_CPU_KERNELS turns the kernels off whatever else is set."""
import logging

import pytest

from dynamoe.ops import cpu_kernels


@pytest.fixture
def broken(monkeypatch, tmp_path):
    """load() pointed at a source that does not compile, built under tmp_path (torch's cache untouched)."""
    src = tmp_path / "broken.cpp"
    src.write_text("#error dynamoe-test-broken-source\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpu_kernels, "SOURCES", (str(src),))
    monkeypatch.setattr(cpu_kernels, "_module_name", lambda here: "dynamoe_test_broken")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpu_kernels, "cpu_supported", lambda: True)
    monkeypatch.delenv(cpu_kernels.ENV_DISABLE, raising=False)
    return monkeypatch


def test_required_build_failure_raises_with_compiler_output(broken):
    broken.setenv(cpu_kernels.ENV_REQUIRE, "1")
    assert cpu_kernels.required()
    with pytest.raises(RuntimeError, match="dynamoe-test-broken-source") as info:
        cpu_kernels.load()
    assert cpu_kernels.ENV_REQUIRE in str(info.value)
    with pytest.raises(RuntimeError) as again:  # remembered: not built a second time
        cpu_kernels.load()
    assert again.value is info.value


def test_without_the_switch_a_failure_falls_back_with_one_warning(broken, caplog):
    broken.delenv(cpu_kernels.ENV_REQUIRE, raising=False)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is None
        assert cpu_kernels.load() is None
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_disabled_wins_over_required(broken):
    broken.setenv(cpu_kernels.ENV_REQUIRE, "1")
    broken.setenv(cpu_kernels.ENV_DISABLE, "1")
    assert not cpu_kernels.required()
    assert cpu_kernels.load() is None


def test_required_only_where_the_kernels_are_written_for(broken):
    broken.setenv(cpu_kernels.ENV_REQUIRE, "1")
    broken.setattr(cpu_kernels, "cpu_supported", lambda: False)
    assert not cpu_kernels.required()
    assert cpu_kernels.load() is None


def _cpuinfo(path, flags: str, mhz: str) -> str:
    path.write_text("".join(f"processor\t: {i}\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\ncpu MHz\t\t: {mhz}\n"
                            f"flags\t\t: {flags}\n\n" for i in range(2)))
    return str(path)


def test_build_name_follows_the_cpu_kind(tmp_path, monkeypatch):
    """A home directory shared by machines of different kinds keeps one build per kind: a library compiled with
    -march=native where AMX exists must never be loaded where it does not (an illegal instruction)."""
    amx = _cpuinfo(tmp_path / "a", "fpu sse avx512f avx512_bf16 amx_bf16 amx_tile", "2400.0")
    amx_busy = _cpuinfo(tmp_path / "b", "fpu sse avx512f avx512_bf16 amx_bf16 amx_tile", "3100.7")
    no_amx = _cpuinfo(tmp_path / "c", "fpu sse avx512f avx512_bf16", "2400.0")
    assert cpu_kernels._cpu_tag(amx) == cpu_kernels._cpu_tag(amx_busy)   # the clock is not the kind
    assert cpu_kernels._cpu_tag(amx) != cpu_kernels._cpu_tag(no_amx)
    assert cpu_kernels._cpu_tag(str(tmp_path / "missing"))   # no /proc: still a name
    monkeypatch.setattr(cpu_kernels, "_cpu_tag", lambda: "kindA")
    a = cpu_kernels._module_name(cpu_kernels.os.path.dirname(cpu_kernels.__file__) + "/csrc")
    monkeypatch.setattr(cpu_kernels, "_cpu_tag", lambda: "kindB")
    assert a != cpu_kernels._module_name(cpu_kernels.os.path.dirname(cpu_kernels.__file__) + "/csrc")
