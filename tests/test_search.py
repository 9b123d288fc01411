"""plan.py --search (trainer/planning/search.py, layout.py): the layout search's mechanism on 8 simulated CPU
devices judged as v5e chips, with a trial of the finalists (on a TPU VM or GPU host the real check)."""

import jax
import pytest
from conftest import micro_config

from parallelism.chips import CHIPS
from trainer.config.errors import ConfigError
from trainer.planning import layout
from trainer.planning.search import LAYOUT_KEYS
from trainer.training.setup import build


def test_the_search_compiles_your_layout_and_the_best_predicted_and_a_trial_picks_the_fastest_measured():
    cfg = micro_config()
    cfg.train.compile_cache = ""
    lines = []
    r = layout.run(cfg, chip="tpu-v5e", devices=jax.devices(), compiles=3, trial=2, progress=lines.append)
    assert r["not_searched"]["expert"].startswith("the model has no experts")
    assert "context" in r["not_searched"] and r["considered"] >= r["fit_arithmetic"] > 0
    # Your layout is compiled first; the others are the best predicted, fastest first.
    compiled = r["compiled"]
    assert compiled[0]["layout"] == r["own"]["layout"] and not compiled[0]["changes"]
    assert len(compiled) == 3 and any("- your layout" in line for line in lines)
    # A layout changes only how the step is laid out: never the model, the batch or the data.
    for row in r["top"] + compiled:
        assert set(row["changes"]) <= set(LAYOUT_KEYS)
    # The trial measured each finalist that fits and picked the fastest measured.
    fitting = [c for c in compiled if c["compiled"]["fits"]]
    assert all(c["measured_seconds"] > 0 for c in fitting)
    assert r["best"]["measured_seconds"] == min(c["measured_seconds"] for c in fitting)
    # The prediction's compute stream is the closed form: the model's FLOPs a device at the chip's peak
    # (the user's layout recomputes nothing: remat none, no loss chunk).
    setup = build(cfg)
    own = r["own"]["predicted"]
    flops = setup.flops_per_token() * cfg.train.global_batch_size * cfg.data.seq_len / 8
    assert own["compute_seconds"] == pytest.approx(flops / CHIPS["tpu-v5e"].peak_flops, rel=1e-9)
    assert own["step_seconds"] >= max(own["compute_seconds"], own["memory_seconds"])


def test_the_search_refuses_in_one_sentence_before_it_compiles():
    cfg = micro_config()
    with pytest.raises(ConfigError, match="does not split over 3 slices"):
        layout.run(cfg, target="v5e-4", slices=3)
    with pytest.raises(ConfigError, match="--trial times each finalist on this machine's own devices"):
        layout.run(cfg, target="v5e-4", trial=2)
