"""The memory arithmetic (trainer/planning/memory.py) against XLA:TPU's HBM heap per device.

benchmarks/memory_calibration.py compiled tiny, small and llm_1b under remat none /
save_dots / full on meshes fsdp=4, data=2 x fsdp=2 and fsdp=2 x tensor=2 for v5e-4
and v5p-8 (54 compiles, 21 minutes on two cores) and recorded XLA's figures in
benchmarks/report/memory_calibration.jsonl. Here today's arithmetic is held to them,
and one of them is compiled again, so the record cannot drift from the libtpu installed.
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
# The cells where the arithmetic is more than 10% off XLA:TPU's HBM heap, and why (the README's memory table).
# At fsdp=4 v5e's latency-hiding scheduler holds the logits and the recomputed layer together (counted: the
# larger; with xla_tpu_enable_latency_hiding_scheduler=false the heaps are 2.82 and 8.67 GiB).
OFF_BY_MORE = {
    ("small", "v5e-4", "full", "fsdp=4"): "-32%",
    ("llm_1b", "v5e-4", "full", "fsdp=4"): "-18%",
}


def recorded() -> list[dict]:
    with open(RECORD) as f:
        return [json.loads(line) for line in f]


def test_the_arithmetic_is_within_10_percent_of_xla_tpu_on_the_recorded_grid():
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
        if abs(counted / heap - 1) > 0.1:
            off[(r["config"], r["compiler"], r["remat"], r["mesh"])] = f"{counted / heap - 1:+.0%}"
    # Exactly the known cells, by as much as the README says: 37 of 45 within 10% of the heap (the six
    # on-chip ones are not), and 34 of the 36 of small and llm_1b.
    assert on_chip == 6 and off == OFF_BY_MORE


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
