"""tupe_jax/host.py: the CPU kind and description read from a cpuinfo file."""
import platform

from tupe_jax import host

TWO_CPUS = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n"
            "cpu MHz\t\t: 1996.249\n"
            "flags\t\t: fpu sse4_2 avx avx2 fma\n\nprocessor\t: 1\nvendor_id\t: GenuineIntel\nflags\t\t: avx512f\n")


def test_the_first_cpu_and_its_widest_vector_isa(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(TWO_CPUS)
    assert host.cpu_info(str(info)) == {"arch": platform.machine(), "vendor": "AuthenticAMD", "model": "AMD EPYC",
                                        "family": "family 23 model 1", "isa": "avx2", "mhz": "1996"}
    assert host.cpu_kind(str(info)) == f"{platform.machine()} AuthenticAMD family 23 model 1 avx2"
    assert host.cpu_description(str(info)) == "AMD EPYC, AuthenticAMD family 23 model 1, avx2, 1996 MHz"
    info.write_text("vendor_id\t: GenuineIntel\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f\n")
    assert host.cpu_kind(str(info)) == f"{platform.machine()} GenuineIntel avx512f"
    # the same ISA on another model is another kind (XLA:CPU compiles for the model: host.py)
    info.write_text(TWO_CPUS.replace("family\t: 23", "family\t: 25"))
    assert host.cpu_kind(str(info)) == f"{platform.machine()} AuthenticAMD family 25 model 1 avx2"


def test_arm_features_and_a_missing_file(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n")
    assert host.cpu_info(str(info))["isa"] == "sve" and host.cpu_info(str(info))["vendor"] == "0x41"
    assert host.cpu_info(str(info))["family"] == "" and host.cpu_description(str(info)) == "0x41, sve"
    assert host.cpu_kind(str(tmp_path / "missing")) == platform.machine()
    assert host.cpu_description(str(tmp_path / "missing")) == ""
