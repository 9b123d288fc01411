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
OFF_BY_MORE = {
    # tiny under remat on v5p: XLA:TPU keeps 24-47 MiB of the step in on-chip memory (VMEM), outside the HBM
    # heap; the count lies between the heap and heap + VMEM. v5e-4 is left out entirely: it keeps most of
    # tiny's step in VMEM.
    ("tiny", "v5p-8", "save_dots", "fsdp=4"): "+13%",
    ("tiny", "v5p-8", "save_dots", "data=2 x fsdp=2"): "+13%",
    ("tiny", "v5p-8", "save_dots", "fsdp=2 x tensor=2"): "+26%",
    ("tiny", "v5p-8", "full", "fsdp=4"): "+37%",
    ("tiny", "v5p-8", "full", "data=2 x fsdp=2"): "+32%",
    ("tiny", "v5p-8", "full", "fsdp=2 x tensor=2"): "+74%",
    # v5e's scheduler held the logits and the recomputed layer together (counted: the larger).
    ("small", "v5e-4", "full", "fsdp=4"): "-30%",
    # llm_1b under full remat keeps less than counted with data=2 x fsdp=2 on v5e and with tensor=2; not traced.
    ("llm_1b", "v5e-4", "full", "data=2 x fsdp=2"): "+10%",
    ("llm_1b", "v5e-4", "full", "fsdp=2 x tensor=2"): "+11%",
    ("llm_1b", "v5p-8", "full", "fsdp=2 x tensor=2"): "+10%",
}


def recorded() -> list[dict]:
    with open(RECORD) as f:
        return [json.loads(line) for line in f]


def test_the_arithmetic_is_within_10_percent_of_xla_tpu_on_the_recorded_grid():
    import memory_calibration as grid

    rows = [r for r in recorded() if r["compiler"] != "cpu"]
    assert len(rows) == 54
    devices = grid.compiler_devices(sorted({r["compiler"] for r in rows}))
    off = {}
    for r in rows:
        if (r["config"], r["compiler"]) == ("tiny", "v5e-4"):
            continue
        error = grid.arithmetic(r, devices[r["compiler"]])["total"] / r["xla"]["total"] - 1
        if abs(error) > 0.1:
            off[(r["config"], r["compiler"], r["remat"], r["mesh"])] = f"{error:+.0%}"
    # Exactly the known cells, by as much as the README says: 35 of 45 within 10%, and 32 of the 36
    # of small and llm_1b.
    assert off == OFF_BY_MORE


def test_a_recorded_compile_is_what_libtpu_compiles_today_and_the_arithmetic_counts_it():
    import memory_calibration as grid

    from trainer.planning.targets import parse_target, target_devices

    row = next(r for r in recorded() if (r["config"], r["compiler"], r["remat"], r["mesh"])
               == ("tiny", "v5p-8", "none", "data=2 x fsdp=2"))  # fmt: skip
    devices = target_devices(parse_target("v5p-8"))
    again = grid.measure(grid.config_for("tiny", "none", grid.MESHES["data=2 x fsdp=2"]), devices)
    assert again["xla"] == row["xla"]
    assert grid.arithmetic(row, devices)["total"] == pytest.approx(again["xla"]["total"], rel=0.1)
