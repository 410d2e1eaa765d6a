"""make bench's serving table of where the engine's time went: deltas of the server's step
counters over a level, per kind, and the share of the wall time spent in steps."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import serving  # noqa: E402


def totals(decode, mixed, prefill):
    return {k: {"steps": v[0], "seconds": v[1], "tokens": v[2]}
            for k, v in (("decode", decode), ("mixed", mixed), ("prefill", prefill))}


def test_step_profile_takes_deltas_per_kind():
    before = totals((10, 0.2, 160), (1, 0.1, 200), (2, 0.2, 256))
    after = totals((110, 2.4, 1760), (3, 0.4, 700), (2, 0.2, 256))
    p = serving.step_profile(before, after, wall=3.0)
    assert p["kinds"]["decode"]["steps"] == 100
    assert abs(p["kinds"]["decode"]["ms"] - 22.0) < 1e-9 and p["kinds"]["decode"]["tokens"] == 16
    assert abs(p["kinds"]["mixed"]["ms"] - 150.0) < 1e-9 and p["kinds"]["mixed"]["tokens"] == 250
    assert p["kinds"]["prefill"] == {"steps": 0, "seconds": 0.0, "ms": 0.0, "tokens": 0.0}
    assert abs(p["busy"] - 2.5 / 3.0) < 1e-9


def test_step_table_rows_and_the_one_stream_note():
    p = serving.step_profile(totals((0, 0, 0), (0, 0, 0), (0, 0, 0)),
                             totals((100, 0.45, 100), (0, 0, 0), (1, 0.08, 128)), wall=0.6)
    rows = [{"concurrency": 1, "output_len": 128, "itl_p50": 4.75, "engine_steps": p},
            {"concurrency": 4, "output_len": 128, "itl_p50": 8.0, "engine_steps": None}]  # a peer's server
    table = serving.step_table(rows)
    assert table[-1] == "| 1 | 128 | 88% | 100 / 4.5 / 1.0 | 0 | 1 / 80.0 / 128.0 |"
    assert len([ln for ln in table if ln.startswith("| 4 ")]) == 0
    note = serving.served_step_note(rows[0], offline_ms=3.5)
    assert "took 4.50 ms (+1.00 against offline" in note and "other +0.25 ms" in note
    assert serving.served_step_note(rows[1], 3.5) == ""
