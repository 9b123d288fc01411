"""The memory arithmetic (trainer/planning/memory.py) against XLA:TPU's HBM heap per device.

benchmarks/memory_calibration.py compiled tiny, small and llm_1b under remat none /
save_dots / full on meshes fsdp=4, data=2 x fsdp=2 and fsdp=2 x tensor=2 for v5e-4
and v5p-8 (54 compiles, 21 minutes on two cores) and recorded XLA's figures in
benchmarks/report/memory_calibration.jsonl: the set the arithmetic was fitted to. Here
today's arithmetic is held to them within bounds, one of them is compiled again, so the
record cannot drift from the libtpu installed, and the held-out set (never fitted to) is
held to the bounds stated before it was compiled.
"""

import json
import os
import sys

import pytest
from conftest import REPO

from trainer.planning.targets import installed

pytestmark = pytest.mark.skipif(not installed("libtpu"), reason='pip install -e ".[tpu]"')
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

RECORD = os.path.join(REPO, "benchmarks", "report", "memory_calibration.jsonl")
HELDOUT_RECORD = os.path.join(REPO, "benchmarks", "report", "memory_heldout.jsonl")


def recorded() -> list[dict]:
    with open(RECORD) as f:
        return [json.loads(line) for line in f]


def test_the_arithmetic_holds_its_bounds_on_the_grid_it_was_fitted_to():
    import memory_calibration as grid

    rows = [r for r in recorded() if r["compiler"] != "cpu"]
    assert len(rows) == 54
    devices = grid.compiler_devices(sorted({r["compiler"] for r in rows}))
    off, on_chip = {}, 0
    for r in rows:
        if (r["config"], r["compiler"]) == ("tiny", "v5e-4"):
            continue  # v5e keeps 37-112 MiB of tiny's 53-194 MiB step in on-chip memory (VMEM)
        counted, heap = grid.arithmetic(r, devices[r["compiler"]])["total"], r["xla"]["total"]
        if (r["config"], r["remat"]) in (("tiny", "save_dots"), ("tiny", "full")):
            # v5p keeps 25-48 MiB of it in VMEM, outside the heap: the count lies between the two.
            assert heap < counted <= heap + r["xla"]["vmem"], r
            on_chip += 1
            continue
        off[(r["config"], r["compiler"], r["remat"], r["mesh"])] = counted / heap - 1
    # Bounds, not the cells: 37 of the 45 within 10% of the heap when this was written (the six on-chip ones
    # are not judged), every one within 35% (the worst, small and llm_1b under full remat at fsdp=4 on v5e,
    # where its latency-hiding scheduler holds the logits and the recomputed layer together: -32% and -18%).
    assert on_chip == 6 and len(off) == 39
    assert sum(abs(e) <= 0.1 for e in off.values()) >= 37 and max(map(abs, off.values())) <= 0.35


def test_the_held_out_compiles_are_within_the_bounds_stated_before_they_were_compiled():
    """The held-out set (memory_calibration.py HELDOUT): compiled once, never fitted to. Its record keeps the
    arithmetic of the day; today's must be the same, or memory.py has changed what it says about them (a
    refit, or a change that moves them) and they are no longer held out: choose a new set and compile it."""
    import statistics

    import memory_calibration as grid

    with open(HELDOUT_RECORD) as f:
        rows = [json.loads(line) for line in f]
    assert sorted((r["cell"], r["config"], r["compiler"]) for r in rows) == sorted(
        (name, config, target) for name, config, _, target, _ in grid.HELDOUT)  # fmt: skip
    for r in rows:
        assert grid.heldout_arithmetic(r) == r["arithmetic"], (
            f"memory.py now says {grid.heldout_arithmetic(r)} bytes for the held-out cell {r['cell']} "
            f"({r['config']} on {r['compiler']}), where it said {r['arithmetic']}: the held-out set is spent."
        )
    errors = [abs(r["arithmetic"] / r["xla"]["total"] - 1) for r in rows if "xla" in r]
    assert len(errors) >= 30
    assert max(errors) <= grid.HELDOUT_BOUND and statistics.median(errors) <= grid.HELDOUT_MEDIAN_BOUND
    # The interval plan.py prints beside the arithmetic holds every held-out heap.
    from trainer.planning.memory import HELDOUT_ERROR, heap_interval

    assert HELDOUT_ERROR == grid.HELDOUT_BOUND
    for r in rows:
        low, high = heap_interval(r["arithmetic"])
        assert low <= r["xla"]["total"] <= high, r["cell"]


def test_a_recorded_compile_is_what_libtpu_compiles_today_and_the_arithmetic_counts_it():
    import memory_calibration as grid

    from trainer.planning.targets import parse_target, target_devices

    row = next(r for r in recorded() if (r["config"], r["compiler"], r["remat"], r["mesh"])
               == ("tiny", "v5p-8", "none", "data=2 x fsdp=2"))  # fmt: skip
    devices = target_devices(parse_target("v5p-8"))
    again = grid.measure(grid.config_for("tiny", "none", grid.MESHES["data=2 x fsdp=2"]), devices)
    # Within 1%, not equal: the train state and step gained a few scalars after the grid was recorded (the
    # clock's two-word counts, commit 1b6bab6), moving tiny's heap by 4 KB and its code by 20 KB of 7 MB.
    assert again["xla"] == pytest.approx(row["xla"], rel=0.01)
    assert grid.arithmetic(row, devices)["total"] == pytest.approx(again["xla"]["total"], rel=0.1)
