"""The machine name every benchmark table carries: two VMs may both call their CPU "AMD EPYC"."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import readme_tables  # noqa: E402


def cpuinfo(vendor: str, family: int, model: int, name: str = "AMD EPYC") -> str:
    cpu = f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\nmodel name\t: {name}\n"
    return cpu + cpu.replace("processor\t: 0", "processor\t: 1")


def test_the_name_carries_family_model_and_zen_generation():
    assert readme_tables.cpu_name(cpuinfo("AuthenticAMD", 25, 17)) == "AMD EPYC (family 25, model 17: Zen 4)"
    assert readme_tables.cpu_name(cpuinfo("AuthenticAMD", 25, 1)) == "AMD EPYC (family 25, model 1: Zen 3)"
    assert readme_tables.cpu_name(cpuinfo("AuthenticAMD", 26, 2)) == "AMD EPYC (family 26, model 2: Zen 5)"
    assert readme_tables.cpu_name(cpuinfo("AuthenticAMD", 23, 49)) == "AMD EPYC (family 23, model 49: Zen 2)"
    xeon = cpuinfo("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8481C")
    assert readme_tables.cpu_name(xeon) == "Intel(R) Xeon(R) Platinum 8481C (family 6, model 143)"
    assert readme_tables.cpu_name("model name\t: some CPU\n") == "some CPU"


def test_the_run_stamp_says_when_and_from_which_commit():
    assert readme_tables.run_stamp(0, "abc1234") == "1970-01-01 00:00 UTC, commit abc1234"
    assert readme_tables.run_stamp(86400 * 365, "") == "1971-01-01 00:00 UTC"
