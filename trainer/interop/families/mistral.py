"""Mistral (`MistralForCausalLM`): Llama's decoder with a sliding window on every layer."""

from __future__ import annotations

from trainer.interop.families import core
from trainer.model.spec import Architecture

CLASSES = {"mistral": "MistralForCausalLM"}
LAYOUT = core.Layout()


def claims(spec: Architecture) -> str | None:
    return "mistral" if core.plain(spec) and spec.sliding_window and not spec.moe.num_experts else None


def config(spec: Architecture, common: dict) -> dict:
    return {**common, "sliding_window": spec.sliding_window}


def model_keys(config: dict) -> dict:
    return {**core.model_keys(config, core.rope_of(config), {}), "sliding_window": config.get("sliding_window") or 0}
