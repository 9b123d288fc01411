"""The planner against closed forms: parameter count, FLOPs per token, sharded state bytes."""

import json
import os
import subprocess
import sys

import jax
import pytest
from conftest import micro_config

from trainer.planning import plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def closed_form_params(m, tied):
    head_dim = m.d_model // m.n_heads
    attention = m.d_model * head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    per_layer = attention + 3 * m.d_model * m.d_ff + 2 * m.d_model
    embeddings = m.vocab_size * m.d_model * (1 if tied else 2)
    return m.n_layers * per_layer + embeddings + m.d_model


@pytest.mark.parametrize("tied", [False, True])
def test_counts_and_flops_match_closed_forms(tied):
    cfg = micro_config(model=dict(tie_embeddings=tied))
    m = cfg.model
    result = plan(cfg, compile_step=False)
    assert result["n_params"] == closed_form_params(m, tied)
    assert result["n_params_non_embedding"] == result["n_params"] - m.vocab_size * m.d_model * (1 if tied else 2)
    matmul_params = result["n_params"] - (0 if tied else m.vocab_size * m.d_model)
    attention = 12 * m.n_layers * m.d_model * cfg.data.seq_len  # n_heads * head_dim = d_model
    assert result["flops_per_token"] == 6 * matmul_params + attention


def test_compiled_state_bytes_shrink_eightfold_under_fsdp():
    """Arguments = fp32 params + two Adam moments (12 bytes/parameter) + the int32 batch, per device."""
    one = plan(micro_config(mesh=dict(fsdp=1)), devices=jax.devices()[:1])
    eight = plan(micro_config(mesh=dict(fsdp=8)))
    state_bytes = 12 * one["n_params"]
    batch_bytes = 3 * 4 * 8 * 32  # tokens, segment ids, positions: int32 (8, 32)
    assert one["compiled_breakdown"]["arguments"] == pytest.approx(state_bytes + batch_bytes, rel=0.01)
    assert eight["compiled_breakdown"]["arguments"] == pytest.approx((state_bytes + batch_bytes) / 8, rel=0.01)
    assert eight["compiled_bytes_per_device"] >= eight["compiled_breakdown"]["arguments"]


def test_llm_1b_plans_on_eight_simulated_cpu_devices():
    result = subprocess.run(
        [sys.executable, "scripts/plan.py", "--config", "configs/llm_1b.py", "--simulate_devices", "8", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert 1.0e9 <= out["n_params"] <= 1.3e9
    assert out["devices"] == 8 and out["mesh"]["fsdp"] == 8
    # fp32 parameters and two fp32 moments, split over 8 devices.
    assert out["compiled_breakdown"]["arguments"] == pytest.approx(12 * out["n_params"] / 8, rel=0.02)
    assert out["compiled_bytes_per_device"] > out["compiled_breakdown"]["arguments"]
    assert out["flops_per_token"] > 6 * out["n_params_non_embedding"]
