"""`cpuserve selftest`: passes on every ISA of this CPU, and fails (exit 1) when a kernel is wrong."""
import json

import pytest

from cpuserve import _C
from cpuserve.entrypoints.cli import main
from cpuserve.model_executor import ops, selftest


def test_every_kernel_on_every_isa_passes():
    checks = selftest.run()
    assert {c.isa for c in checks} == set(_C.available_isas())
    assert {c.kernel for c in checks} == {"rms_norm", "silu_and_mul", "rotary", "reshape_and_cache",
                                          "paged_attention", "linear", "w8a8_linear", "int8_dot_linear"}
    assert all(c.ok for c in checks), selftest.format_checks(checks)


def test_a_wrong_kernel_fails_the_selftest(monkeypatch, capsys):
    real = ops.rms_norm
    monkeypatch.setattr(ops, "rms_norm", lambda x, w, eps, k: real(x, w, eps, k=k) * 1.001)
    assert main(["selftest", "--json", "--isa", "scalar"]) == 1
    report = json.loads(capsys.readouterr().out)
    bad = [c for c in report["checks"] if not c["ok"]]
    assert [c["kernel"] for c in bad] == ["rms_norm"]


def test_nan_is_a_failure():
    assert not selftest.Check("scalar", "x", "float32", float("nan"), 1e-4).ok


def test_unknown_isa_is_a_clear_error(capsys):
    assert main(["selftest", "--isa", "sparc"]) == 2
    assert "not compiled in or not supported" in capsys.readouterr().err


@pytest.mark.parametrize("isa", _C.available_isas())
def test_cli_table_names_each_isa(isa, capsys):
    assert main(["selftest", "--isa", isa]) == 0
    out = capsys.readouterr().out
    assert out.count(f"\n{isa} ") >= 9
