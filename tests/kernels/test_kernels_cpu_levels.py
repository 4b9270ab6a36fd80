"""The instruction-set levels of the CPU kernels (kernels/cpu/__init__.py) and what ``auto`` loads on each
shape of /proc/cpuinfo: the level a native build reaches, the model's dtype there, and the quantise mode a
quantised file resolves to (backends/cpu/passes.py). The shapes are the CPUs people run: an AMD Zen 3 (AVX2
only), an Intel Xeon without BF16 (AVX-512F), a Zen 4 or Sapphire Rapids (AVX-512 BF16), an old x86-64
without AVX2, and an ARM server."""

from __future__ import annotations

import platform

import pytest

from inferflux.backends.cpu import passes
from inferflux.kernels import cpu as cpu_kernels

X86 = {"sse2", "sse4_2", "avx", "popcnt"}
AVX2 = X86 | {"avx2", "fma", "f16c", "bmi2"}
SHAPES = {
    # name: (machine, flags, level, dtype auto loads, quantise mode auto resolves to for a quantised file)
    "zen3": ("x86_64", AVX2, "avx2", "float32", "blocks"),
    "xeon-no-bf16": ("x86_64", AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "avx512", "float32",
                     "exact"),
    "zen4": ("x86_64", AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}, "avx512-bf16", "bfloat16",
             "exact"),
    "old-x86": ("x86_64", X86, "generic", "float32", "blocks"),
    "graviton": ("aarch64", {"fp", "asimd", "fphp", "asimdhp", "asimddp"}, "neon", "float32", "blocks"),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_autos_choice_on_each_cpu_shape(shape: str) -> None:
    machine, flags, level, dtype, mode = SHAPES[shape]
    assert cpu_kernels.expected_isa(flags, machine) == level
    # The dtype: bfloat16 where the CPU multiplies it itself (backends/cpu/backend.py's rule, on these flags).
    assert ("bfloat16" if cpu_kernels.native_bf16(flags) else "float32") == dtype
    # exact_linear builds for float32 rows on every level, for bfloat16 rows only with AVX-512 BF16.
    exact_ok = dtype == "float32" or level == "avx512-bf16"
    assert passes.resolve_mode("auto", dtype_name=dtype, exact_ok=exact_ok, isa=level) == mode


def test_the_levels_a_host_can_run() -> None:
    on_x86 = platform.machine().lower() in ("x86_64", "amd64")
    avx512 = AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    assert cpu_kernels.host_isas(avx512) == (["auto", "avx512", "avx2", "generic"] if on_x86 else ["auto", "generic"])
    # AVX-512F alone is not x86-64-v4: the avx512 level's build would use instructions this CPU lacks.
    assert cpu_kernels.host_isas(AVX2 | {"avx512f"}) == (["auto", "avx2", "generic"] if on_x86 else ["auto", "generic"])
    assert cpu_kernels.host_isas(X86) == ["auto", "generic"]


def test_a_level_is_named_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_chosen", None)
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    assert cpu_kernels.requested_isa() == "auto"
    monkeypatch.setenv(cpu_kernels.ISA_ENV, " AVX2 ")
    assert cpu_kernels.requested_isa() == "avx2"
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "native")  # the automatic level's earlier name
    assert cpu_kernels.requested_isa() == "auto"
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match="INFERFLUX_CPU_ISA: .*'avx1024': one of auto, avx512, avx2, generic"):
        cpu_kernels.requested_isa()
    # The settings' choice (runtime.cpu_isa) wins over the environment.
    cpu_kernels.choose("generic")
    assert cpu_kernels.requested_isa() == "generic"
    with pytest.raises(ValueError, match="one of auto, avx512, avx2, generic"):
        cpu_kernels.choose("sse9")


def test_the_settings_pin_a_level_or_leave_it_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from inferflux.backends.cpu.runtime import choose_isa

    monkeypatch.setattr(cpu_kernels, "_chosen", None)
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx2")
    choose_isa(None)  # runtime.cpu_isa unset
    assert cpu_kernels.requested_isa() == "avx2"
    choose_isa("generic")
    assert cpu_kernels.requested_isa() == "generic"


def test_a_pinned_level_loads_float32_as_a_cpu_of_that_level_would(monkeypatch: pytest.MonkeyPatch) -> None:
    from inferflux.backends.cpu import backend

    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: AVX2 | {"avx512f", "avx512bw", "avx512_bf16"})
    monkeypatch.setattr(cpu_kernels, "_chosen", None)
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    assert backend.cpu_has_native_bf16()
    for level in ("avx512", "avx2", "generic"):
        monkeypatch.setenv(cpu_kernels.ISA_ENV, level)
        assert not backend.cpu_has_native_bf16(), level


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ CPU kernels are not built here")
def test_this_hosts_native_build_reaches_the_level_its_flags_say() -> None:
    assert cpu_kernels.isa() == cpu_kernels.expected_isa(cpu_kernels.cpu_flags(), platform.machine())
