"""Llama (`LlamaForCausalLM`): our plain decoder, with Llama 3's RoPE scaling when it has one."""

from __future__ import annotations

from trainer.interop.families import core
from trainer.model.spec import Architecture

CLASSES = {"llama": "LlamaForCausalLM"}
LAYOUT = core.Layout()


def claims(spec: Architecture) -> str | None:
    plain = core.plain(spec) and not (spec.qk_norm or spec.moe.num_experts or spec.sliding_window)
    return "llama" if plain else None


def config(spec: Architecture, common: dict) -> dict:
    return common


def model_keys(config: dict) -> dict:
    return core.model_keys(config, core.rope_of(config), {})
