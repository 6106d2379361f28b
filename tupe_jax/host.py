"""The host CPU, as far as it decides float rounding and speed: XLA:CPU compiles for the host's vector ISA, so the
same program rounds differently (and runs at another speed) on an AVX2 and an AVX-512 machine.

    cpu_info(cpuinfo) -> {'arch', 'vendor', 'model', 'family', 'isa', 'mhz'}   ('' where unknown; Linux /proc/cpuinfo)
    cpu_kind() -> 'x86_64 AuthenticAMD family 23 model 1 avx2'        what decides rounding (tests/behaviour.py)
    cpu_description() -> 'AMD EPYC, AuthenticAMD family 23 model 1, avx2, 1996 MHz'
                                                                      what a benchmark's numbers came from

`family` is x86's 'cpu family' and 'model' numbers: a virtual machine's model name is often only 'AMD EPYC', and
the numbers tell the generations apart (AMD family 23 = Zen 1/2, 25 = Zen 3/4, 26 = Zen 5). They are part of the
kind: XLA:CPU compiles for the host's CPU model as LLVM names it from them, and two models with the same vector ISA
round the same program differently (session 49: an AVX2 Zen 3, family 25 model 1, against tests/data's AVX2
golden runs, recorded on other AMD models: losses ~1e-7 apart).
"""
from __future__ import annotations

import platform

CPUINFO = "/proc/cpuinfo"
# the vector ISAs that change XLA:CPU's code generation, widest first: x86, then Arm
VECTOR_ISAS = ("avx512f", "avx2", "avx", "sve2", "sve", "asimd")


def cpu_info(cpuinfo: str = CPUINFO) -> dict[str, str]:
    """The first CPU's architecture, vendor, model name, family and model numbers, widest vector ISA, clock in MHz."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    flags = set((fields.get("flags") or fields.get("features") or "").split())
    mhz = fields.get("cpu mhz", "")
    family = " ".join(f"{label} {fields[key]}" for key, label in (("cpu family", "family"), ("model", "model"))
                      if fields.get(key))
    return {"arch": platform.machine(), "vendor": fields.get("vendor_id") or fields.get("cpu implementer", ""),
            "model": fields.get("model name", ""), "family": family,
            "isa": next((n for n in VECTOR_ISAS if n in flags), ""),
            "mhz": f"{float(mhz):.0f}" if mhz.replace(".", "", 1).isdigit() else ""}


def cpu_kind(cpuinfo: str = CPUINFO) -> str:
    """'<arch> <vendor> family <f> model <m> <widest vector ISA>' (the parts that are known)."""
    info = cpu_info(cpuinfo)
    return " ".join(part for part in (info["arch"], info["vendor"], info["family"], info["isa"]) if part)


def cpu_description(cpuinfo: str = CPUINFO) -> str:
    """'<model name>, <vendor> <family>, <widest vector ISA>, <clock> MHz' (the parts that are known)."""
    info = cpu_info(cpuinfo)
    maker = " ".join(part for part in (info["vendor"], info["family"]) if part)
    parts = (info["model"], maker, info["isa"], info["mhz"] and f"{info['mhz']} MHz")
    return ", ".join(part for part in parts if part)
