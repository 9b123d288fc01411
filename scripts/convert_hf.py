"""Move weights between this trainer and Hugging Face's formats, Llama, Mistral, Qwen3, Mixtral, Qwen3-MoE,
Gemma 3, DeepSeek-V3, Qwen3.5, Qwen3.5-MoE or Qwen3-Next by the model's architecture (Qwen3.5's Hub
checkpoints with their vision tower: the text model is read, the rest kept and put back on export; needs the
hf extra: pip install -e ".[hf]"):

    python scripts/convert_hf.py export --config configs/tiny.py --workdir runs/tiny [--step N] --out hf/tiny
    python scripts/convert_hf.py import --hf hf/tiny --config configs/tiny.py --workdir runs/tiny-imported

A LoRA run (model.lora) exports with --out as its base with the adapters merged in, and with --adapter DIR
as a PEFT adapter directory that peft.PeftModel.from_pretrained loads on the export of its base;
import --adapter DIR takes a PEFT adapter in beside the model of --hf (docs/post_training.md).

An exported directory loads with transformers' AutoModelForCausalLM and
AutoTokenizer. An imported one is step 0 of a run that train.py continues and
eval.py evaluates; the config's model section must describe the same model.
"""

from absl import flags

from trainer.config.errors import ConfigError
from trainer.interop.huggingface import export_checkpoint, import_checkpoint
from trainer.run import cli

_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; default runs/<config name>.")
_STEP = flags.DEFINE_integer("step", None, "export: checkpoint step; default the newest.")
_OUT = flags.DEFINE_string("out", None, "export: directory to write.")
_HF = flags.DEFINE_string("hf", None, "import: Hugging Face model directory to read.")
_ADAPTER = flags.DEFINE_string(
    "adapter",
    None,
    "A PEFT adapter directory: export writes a LoRA run's adapters there; import reads one beside --hf.",
)


def main(args):
    workdir = _WORKDIR.value or cli.default_workdir()
    if args == ["export"]:
        if not (_OUT.value or _ADAPTER.value):
            raise ConfigError("export needs --out DIR (the model), --adapter DIR (a LoRA run's adapters), or both.")
        for out, adapter in ((_ADAPTER.value, True), (_OUT.value, False)):
            if out:
                step = export_checkpoint(_CONFIG.value, workdir, _STEP.value, out, adapter=adapter, say=print)
                whose = "'s adapters" if adapter else ""
                print(f"exported step {step} of {workdir}{whose} to {out}")
                if adapter:
                    print(base_hint(workdir, out))
    elif args == ["import"]:
        if not _HF.value:
            raise ConfigError("import needs --hf DIR.")
        aside = import_checkpoint(_HF.value, _CONFIG.value, workdir, _ADAPTER.value)
        if aside:
            print(aside)
        print(
            f"imported {_HF.value}{f' with the adapter {_ADAPTER.value}' * bool(_ADAPTER.value)} into {workdir} "
            "as step 0"
        )
    else:
        raise ConfigError("say what to do: convert_hf.py export ... or convert_hf.py import ...")


def base_hint(workdir: str, out: str) -> str:
    """How to give an exported adapter the base peft loads it on: its base is one of our runs (init_from)."""
    from trainer.training.resume import parse_init_from, saved_config

    base, step = parse_init_from(saved_config(workdir).checkpoint.init_from)
    return (
        f"its base is {base} at step {step}: export that with scripts/convert_hf.py export --config "
        f"{base}/config.json --step {step} --out BASE, then load the adapter on it with "
        f"peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), {out!r}), or set "
        f"base_model_name_or_path to BASE in {out}/adapter_config.json for AutoPeftModelForCausalLM."
    )


if __name__ == "__main__":
    cli.run(main, takes_args=True)
