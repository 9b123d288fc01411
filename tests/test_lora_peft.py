"""LoRA adapters in and out of Hugging Face PEFT's form, against peft and transformers: a LoRA run's adapter
loaded by PeftModel.from_pretrained on the export of its base gives our logits, as does its merged export;
a PEFT adapter imported beside its base gives PEFT's logits; an adapter of another rank is one sentence."""

import json

import jax
import numpy as np
import pytest
from conftest import micro_config

torch = pytest.importorskip("torch", reason="the hf extra is not installed: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e '.[hf]'")
peft = pytest.importorskip("peft", reason="the post extra is not installed: pip install -e '.[post]'")

from trainer.config.errors import ConfigError  # noqa: E402
from trainer.interop.huggingface import export_checkpoint, import_checkpoint  # noqa: E402
from trainer.model import adapters  # noqa: E402
from trainer.run.loop import train  # noqa: E402
from trainer.training.resume import load_init_params, load_params, saved_config  # noqa: E402
from trainer.training.setup import build  # noqa: E402

TOKENS = np.random.default_rng(0).integers(3, 384, (2, 24))


def logits_of(model) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def ours(cfg, workdir) -> np.ndarray:
    setup, _, params = load_params(cfg, workdir)
    return np.asarray(jax.jit(setup.model.apply)(params, TOKENS))


def hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


# Qwen3's case (~20 s, 2026-11-29) in pytest -m slow, which CI runs too: its query/key norms go both ways in
# Qwen3.5's test below as well.
@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_adapters_go_to_peft_and_come_back_with_the_same_logits(tmp_path, family):
    model = dict(qk_norm=True, head_dim=32) if family == "qwen3" else {}
    base = micro_config(model=model, train=dict(steps=2), checkpoint={"every_steps": 2})
    train(base, str(tmp_path / "base"))
    lora = micro_config(
        model=model, train=dict(steps=3), checkpoint={"every_steps": 3, "init_from": str(tmp_path / "base")}
    )
    lora.model.lora.update(rank=4, alpha=8.0)
    train(lora, str(tmp_path / "lora"))
    ours_logits = ours(lora, str(tmp_path / "lora"))

    # Out: the base's export, the adapter loaded on it by peft, and the merged export.
    export_checkpoint(base, str(tmp_path / "base"), None, str(tmp_path / "hf_base"))
    export_checkpoint(lora, str(tmp_path / "lora"), None, str(tmp_path / "adapter"), adapter=True)
    export_checkpoint(lora, str(tmp_path / "lora"), None, str(tmp_path / "merged"))
    adapted = peft.PeftModel.from_pretrained(hf(str(tmp_path / "hf_base")), str(tmp_path / "adapter"))
    base_logits = logits_of(hf(str(tmp_path / "hf_base")))
    assert np.max(np.abs(ours_logits - base_logits)) > 1e-3  # three steps moved the adapters
    np.testing.assert_allclose(logits_of(adapted), ours_logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits_of(hf(str(tmp_path / "merged"))), ours_logits, rtol=1e-4, atol=1e-4)

    # A run that starts from the LoRA run (checkpoint.init_from) starts from the model its adapters make: the
    # base with them merged in, for a full fine-tune and as the frozen base of new adapters alike.
    for rank in (0, 4):
        onward = micro_config(model=model, checkpoint={"init_from": str(tmp_path / "lora")})
        onward.model.lora.update(rank=rank, alpha=8.0)
        setup = build(onward)
        start, _, _ = load_init_params(onward, setup)
        if rank:
            start = adapters.join(adapters.switched_off(adapters.split(setup.new_state().params)[0]), start)
        np.testing.assert_allclose(np.asarray(jax.jit(setup.model.apply)(start, TOKENS)), ours_logits, rtol=1e-4,
                                   atol=1e-4)  # fmt: skip

    # In: an adapter peft made (random A and B), beside the same base, gives peft's logits here.
    made = peft.get_peft_model(hf(str(tmp_path / "hf_base")), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"], init_lora_weights=False))  # fmt: skip
    made.save_pretrained(str(tmp_path / "made"))
    fresh = micro_config(model=model)
    fresh.model.lora.update(rank=4, alpha=8.0)
    import_checkpoint(str(tmp_path / "hf_base"), fresh, str(tmp_path / "imported"), str(tmp_path / "made"))
    saved = saved_config(str(tmp_path / "imported"))  # the run's config.json: its base pinned at <workdir>/base
    assert saved.checkpoint.init_from == f"{tmp_path / 'imported' / 'base'}@0"
    np.testing.assert_allclose(ours(saved, str(tmp_path / "imported")), logits_of(made), rtol=1e-4, atol=1e-4)

    # peft's per-module alpha (alpha_pattern: a pattern matched at the end of each module's name, the first that
    # matches wins) is honoured: layer 1's q_proj at 32 and every v_proj at 2, against lora_alpha 8.
    patterned = peft.get_peft_model(hf(str(tmp_path / "hf_base")), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"], init_lora_weights=False,
        alpha_pattern={"model.layers.1.self_attn.q_proj": 32, "v_proj": 2}))  # fmt: skip
    patterned.save_pretrained(str(tmp_path / "patterned"))
    import_checkpoint(str(tmp_path / "hf_base"), fresh, str(tmp_path / "imported_pattern"), str(tmp_path / "patterned"))
    again = saved_config(str(tmp_path / "imported_pattern"))
    np.testing.assert_allclose(ours(again, str(tmp_path / "imported_pattern")), logits_of(patterned), rtol=1e-4,
                               atol=1e-4)  # fmt: skip

    # What the adapters here cannot hold is refused by its field, before anything is written: another rank for
    # some modules, a trained head of its own (modules_to_save, common when chat tokens are added), the rest.
    fresh.model.lora.rank = 8
    with pytest.raises(ConfigError, match=r"made with model.lora.rank=4 \(config has 8\)"):
        import_checkpoint(str(tmp_path / "hf_base"), fresh, str(tmp_path / "refused"), str(tmp_path / "made"))
    fresh.model.lora.rank = 4
    refusals = [
        (
            dict(rank_pattern={"q_proj": 8}),
            r"rank_pattern gives model.layers.0.self_attn.q_proj rank 8 where "
            r"model.lora.rank is 4; .*every projection one rank",
        ),
        (
            dict(modules_to_save=["lm_head"]),
            r"modules_to_save=\['lm_head'\]: the adapter carries trained "
            r"lm_head weights of its own.*merge_and_unload",
        ),
        (
            dict(target_modules=["q_proj", "v_proj"]),
            r"made with model.lora.targets='q,v' \(config has "
            r"'q,k,v,o,gate,up,down'\); set model.lora to match it.$",
        ),
        (dict(bias="all"), r"bias='all'"),
        (dict(layers_to_transform=[0]), r"layers_to_transform=\[0\]"),
        # Inits whose load rewrites the base (PEFT subtracts the initial B0 A0 from it when it loads them).
        (dict(init_lora_weights="pissa"), r"init_lora_weights='pissa': PEFT's load rewrites the base weights"),
        (dict(init_lora_weights="olora"), r"init_lora_weights='olora': PEFT's load rewrites the base weights"),
    ]
    for i, (change, says) in enumerate(refusals):
        every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        change = {"target_modules": every, **change}
        other = peft.get_peft_model(hf(str(tmp_path / "hf_base")), peft.LoraConfig(
            **{"r": 4, "lora_alpha": 8, "init_lora_weights": False, **change}))  # fmt: skip
        other.save_pretrained(str(tmp_path / f"other{i}"))
        with pytest.raises(ConfigError, match=says):
            import_checkpoint(str(tmp_path / "hf_base"), fresh, str(tmp_path / "refused"), str(tmp_path / f"other{i}"))
    assert not (tmp_path / "refused").exists()  # refused before anything was written


def test_qwen3_5s_adapters_on_every_projection_come_in_from_peft_and_go_back(tmp_path):
    """The Hub's form of Qwen3.5 (Qwen3_5ForConditionalGeneration, its layers under model.language_model),
    small and random: an adapter peft made on every projection (the full-attention layer's q_proj with its gate
    rows, the linear layers' in_proj_qkv, in_proj_z and out_proj) imports beside it with peft's logits; its
    export loads back into peft on the base's export with the same logits, and the merged export is the same
    class with them too."""
    from test_huggingface import QWEN3_5, QWEN3_5_OURS, qwen3_5

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)  # fmt: skip
    config = transformers.Qwen3_5Config(text_config=QWEN3_5, vision_config=vision)
    qwen3_5(transformers.Qwen3_5ForConditionalGeneration, config).save_pretrained(str(tmp_path / "hub"))
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv", "in_proj_z",
             "out_proj"]  # fmt: skip

    def base():
        return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(tmp_path / "hub"), dtype=torch.float32)

    made = peft.get_peft_model(base(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=every,
                                                       init_lora_weights=False))  # fmt: skip
    made.save_pretrained(str(tmp_path / "made"))
    theirs = logits_of(made)
    assert np.max(np.abs(theirs - logits_of(base()))) > 1e-2  # the adapters do something
    cfg = micro_config(model=QWEN3_5_OURS)
    cfg.model.lora.update(rank=4, alpha=8.0)
    import_checkpoint(str(tmp_path / "hub"), cfg, str(tmp_path / "run"), str(tmp_path / "made"))
    saved = saved_config(str(tmp_path / "run"))
    np.testing.assert_allclose(ours(saved, str(tmp_path / "run")), theirs, rtol=1e-4, atol=1e-4)

    export_checkpoint(saved, str(tmp_path / "run"), None, str(tmp_path / "adapter"), adapter=True)
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert sorted(json.load(f)["target_modules"]) == sorted(every)
    again = peft.PeftModel.from_pretrained(base(), str(tmp_path / "adapter"))
    np.testing.assert_allclose(logits_of(again), theirs, rtol=1e-4, atol=1e-4)
    export_checkpoint(saved, str(tmp_path / "run"), None, str(tmp_path / "merged"))
    merged = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(tmp_path / "merged"),
                                                                          dtype=torch.float32)  # fmt: skip
    np.testing.assert_allclose(logits_of(merged), theirs, rtol=1e-4, atol=1e-4)
