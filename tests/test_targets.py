"""Planning for a Cloud TPU slice with the real TPU compiler (libtpu, the `tpu` extra), no TPU present."""

import importlib.util
import json
import math
import re
import subprocess
import sys

import jax
import pytest
from conftest import REPO, micro_config

from parallelism import hlo
from parallelism.chips import CHIPS, chip_of
from trainer.config.errors import ConfigError
from trainer.config.forms import flatten, from_file, with_changes
from trainer.model.flops import attention_forward_flops
from trainer.planning.plan import plan
from trainer.planning.targets import GENERATIONS, cudnn_missing, installed, parse_target, target_devices
from trainer.training.setup import build
from trainer.training.step import abstract_batch

needs_libtpu = pytest.mark.skipif(not installed("libtpu"), reason='pip install -e ".[tpu]"')
# CI installs the gpu extra (JAX's CUDA plugin, 1.1 GB); elsewhere these skip with the command that installs it.
needs_cuda_plugin = pytest.mark.skipif(not installed("jax_plugins.xla_cuda12"), reason='pip install -e ".[gpu]"')


def bf16_model(**mesh):
    """Widths that fill TPU's 128-lane tiles (a 64-wide model's arrays are half padding), bf16 compute."""
    cfg = micro_config(mesh=dict(data=1, fsdp=-1, tensor=1) | mesh)
    cfg.model.update(d_model=256, d_ff=768, n_heads=8, n_kv_heads=4)
    cfg.precision.compute_dtype = "bfloat16"
    return cfg


def test_accelerator_types_name_their_slices():
    assert parse_target("v5e-4").topology == "v5e:2x2"
    assert parse_target("v5litepod-16").topology == "v5e:4x4"
    assert parse_target("v5p-8").topology == "v5p:2x2x1"  # 8 TensorCores = 4 megacore chips
    assert parse_target("v4-128").topology == "v4:4x4x4"
    assert parse_target("v5p-12288").topology == "v5p:16x16x24"
    assert parse_target("v6e-256").topology == "v6e:16x16"
    for name, g in GENERATIONS.items():
        for chips in g.chip_counts:
            target = parse_target(f"{name}-{chips * g.cores_per_chip}")
            assert math.prod(int(d) for d in target.topology.split(":")[1].split("x")) == chips
    with pytest.raises(ConfigError, match=r"unknown target 'a100-8'; the known targets are: h100-N for N in 1, 2"):
        parse_target("a100-8")
    with pytest.raises(ConfigError, match="'v5p-6' is not a v5p slice Cloud TPU offers"):
        parse_target("v5p-6")


def test_a_target_without_libtpu_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    with pytest.raises(ConfigError, match=r'install it with: pip install -e "\.\[tpu\]"'):
        target_devices(parse_target("v5e-4"))

    def no_plugins(name, *a):  # as find_spec behaves when the jax_plugins package is absent
        if name.startswith("jax_plugins."):
            raise ModuleNotFoundError(name)
        return real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", no_plugins)
    with pytest.raises(ConfigError, match=r'install it with: pip install -e "\.\[gpu\]"'):
        target_devices(parse_target("h100-8"))


@needs_libtpu
def test_libtpu_builds_the_slices_we_name():
    for name, devices, kind in (("v5e-8", 8, "TPU v5 lite"), ("v4-8", 4, "TPU v4"), ("v5p-16", 8, "TPU v5"),
                                ("v6e-1", 1, "TPU v6 lite")):  # fmt: skip
        found = target_devices(parse_target(name))
        assert len(found) == devices and found[0].device_kind == kind
    two = target_devices(parse_target("v5e-4"), slices=2)
    assert sorted({d.slice_index for d in two}) == [0, 1]
    with pytest.raises(ConfigError, match="needs 8 devices but 4 are available"):
        plan(bf16_model(fsdp=8), target="v5e-4")


@needs_libtpu
def test_fsdp_on_two_v5e_slices_and_a_v5p_slice_compile_fit_and_communicate_like_the_textbook(tmp_path):
    for target, slices, mesh in (("v5e-4", 2, dict(dcn_data=2)), ("v5p-8", 1, {})):
        cfg = bf16_model(**mesh)
        cfg.train.compile_cache = str(tmp_path / "cache")
        result = plan(cfg, target=target, slices=slices)
        # Planned again: what the compile gave is kept (train.compile_cache), the same to the byte.
        again = plan(cfg, target=target, slices=slices)
        assert not result["compile_kept"] and again["compile_kept"]
        assert [again[k] for k in COMPILED] == [result[k] for k in COMPILED]
        assert result["devices"] == 4 * slices and result["mesh"]["fsdp"] == 4 and result["mesh"]["data"] == slices
        assert result["fits"] and 0 < result["compiled_bytes_per_device"] < result["usable_hbm_bytes_per_device"]
        # The figure is XLA:TPU's HBM heap, read from its buffer-assignment report: it holds the state, and
        # it is less than memory_analysis()'s arguments + temporaries, which overstates it.
        memory = result["compiled_breakdown"]
        assert result["compiled_bytes_per_device"] == memory["heap"]
        assert memory["arguments"] < memory["heap"] < memory["arguments"] + memory["temporaries"]
        measured, textbook = result["collectives"]["measured"], result["collectives"]["textbook"]
        # Forward and backward gather the bf16 weights a device lacks (measured: 0.93 and 0.94 of it).
        assert measured["all-gather"]["sent"] == pytest.approx(textbook["all-gather"], rel=0.15)
        # Gradients: reduce-scattered over fsdp, all-reduced over the slices' data axis. XLA:TPU
        # all-reduces some small ones whole where a scatter would do (measured: 1.01x and 1.34x).
        grads = sum(measured[k]["sent"] for k in ("reduce-scatter", "all-reduce") if k in measured)
        assert 0.9 < grads / (textbook["reduce-scatter"] + textbook.get("all-reduce", 0)) < 1.5
        # Remat off: the compiled matmuls are the model's 6N + attention FLOPs, once (the layer
        # scan's trips counted: XLA's own cost_analysis() counts its body once).
        cost = result["cost"]
        assert cost["flops"] == pytest.approx(result["flops_per_step"] / result["devices"], rel=0.02)
        assert cost["roofline_seconds"] > 0 and 0 < cost["mfu_ceiling"] <= 1


COMPILED = ("compiled_bytes_per_device", "compiled_breakdown", "cost", "collectives", "fits")


@needs_libtpu
def test_a_step_xla_tpu_refuses_is_reported_with_the_heap_it_needed(tmp_path):
    """A batch no v5e chip holds: the plan's verdict, not an error, with the heap from XLA:TPU's report, the
    "HLO temporaries" its message states (the state included)."""
    cfg = bf16_model()
    cfg.train.update(global_batch_size=16384, grad_accum_steps=1)
    cfg.train.compile_cache = str(tmp_path / "cache")
    result = plan(cfg, target="v5e-1")
    assert not result["fits"] and "cost" not in result
    again = plan(cfg, target="v5e-1")  # the refusal is kept too
    assert again["compile_kept"] and again["out_of_memory"] == result["out_of_memory"]
    stated = re.search(r"HLO temporaries \(([\d.]+)G\)", result["out_of_memory"])
    assert stated, result["out_of_memory"]
    needed = result["compiled_bytes_per_device"]
    assert needed / 2**30 == pytest.approx(float(stated.group(1)), abs=0.006)
    assert needed > result["usable_hbm_bytes_per_device"]
    # Planned on a TPU VM's own chips (no --target: the devices are given), the same verdict.
    own = plan(cfg, devices=target_devices(parse_target("v5e-1")))
    assert not own["fits"] and own["compiled_bytes_per_device"] == needed and "target" not in own


@needs_libtpu
def test_hbm_traffic_read_from_the_hlo_matches_xla_on_a_step_without_loops():
    """XLA's own analysis is right when there is no loop: an unrolled step is the reference."""
    cfg = bf16_model()
    cfg.model.scan_layers = False
    setup = build(cfg, target_devices(parse_target("v5e-4")))
    batch = abstract_batch(cfg.train.global_batch_size, cfg.data.seq_len, setup.batch_sharding)
    compiled = setup.train_step().lower(setup.abstract_state(), batch).compile()
    module, xla = hlo.read(compiled.as_text()), compiled.cost_analysis()
    assert hlo.bytes_accessed(module) == pytest.approx(xla["bytes accessed"], rel=0.1)
    # XLA also counts elementwise FLOPs (norms, softmax, the optimiser): a few percent here.
    assert 0.9 < hlo.matmul_flops(module) / xla["flops"] < 1.0
    assert jax.devices()[0].platform == "cpu"  # nothing here needed or took a TPU


@needs_libtpu
def test_splash_attention_compiles_for_a_tpu_as_a_mosaic_kernel_per_shard():
    cfg = bf16_model(tensor=2)
    cfg.model.update(attention="auto", max_seq_len=256)  # 'auto' on a TPU: splash
    cfg.data.seq_len = 256
    result = plan(cfg, target="v5e-4")
    # One forward and one fused backward call per layer (no remat here), read from the compiled HLO and
    # counted by the kernel's schedule (tests/test_attention.py): 256 tokens are one 256-block, computed
    # whole. Each device runs 4 rows x 2 key/value heads, of 2 query heads each, 32 wide.
    kernels, a = result["cost"]["kernels"], cfg.model
    assert kernels["calls"] == 2 * a.n_layers * cfg.train.grad_accum_steps and not kernels["uncounted"]
    rows, kv_heads, group, d = 8 // 2, a.n_kv_heads // 2, a.n_heads // a.n_kv_heads, a.d_model // a.n_heads
    per_layer = rows * kv_heads * group * (2 + 5) * 2 * 256 * 256 * d  # forward's 2 matmuls, backward's 5
    assert kernels["flops"] == a.n_layers * cfg.train.grad_accum_steps * per_layer
    # The rest are the HLO's own matmuls: the formula's 6N, without its attention term.
    tokens = result["tokens_per_step"] / result["devices"]
    attention = 3 * attention_forward_flops(build(cfg).spec.arch, 256) * tokens
    six_n = result["flops_per_step"] / result["devices"] - attention
    assert result["cost"]["flops"] - kernels["flops"] == pytest.approx(six_n, rel=0.02)
    assert result["fits"]


@pytest.mark.slow  # four TPU compiles of ~40 s (450 s in CI beside the rest): pytest -m slow
@needs_libtpu
def test_fit_finds_a_variant_that_fits_a_v5e_chip_and_prints_its_command():
    """tiny in bf16 with 640 sequences of 256 a step overflows the 15.75 GiB a v5e chip offers a program
    (XLA:TPU refuses it). The search's answer, taken from the printed command and planned on its own,
    fits: the same model, batch and data, only computed differently. (One chip and one compile of the
    search: TPU compiles of this batch take ~40 s here.)"""
    overrides = ["--config.precision.compute_dtype=bfloat16", "--config.train.global_batch_size=640",
                 "--config.model.attention=dot_product"]  # fmt: skip
    out = subprocess.run([sys.executable, "scripts/plan.py", "--config", "configs/tiny.py", *overrides, "--target",
                          "v5e-1", "--fit", "--fit_compiles", "1", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result["fits"]
    search, best = result["fit"], result["fit"]["best"]
    # Every variant passes the arithmetic here (tiny's 32-wide heads are padded to 128 lanes on a TPU, which
    # the arithmetic does not count): the compiles decide.
    assert best is not None and best["fits"] and search["considered"] >= search["pass_arithmetic"] > 0
    assert "precision.moments_dtype" not in best["changes"]  # fp32 moments fit: no precision given up

    command = search["command"].split()
    assert command[:3] == ["python", "scripts/train.py", "--config=configs/tiny.py"]
    assert all(flag in command for flag in overrides if flag.split("=")[0][9:] not in best["changes"])
    # tiny's own values, then the command's flags, as train.py applies them.
    cfg = from_file(f"{REPO}/configs/tiny.py")
    flags = dict(f.removeprefix("--config.").split("=", 1) for f in command[3:])
    values = flatten(cfg)
    cfg = with_changes(cfg, {key: type(values[key])(text) for key, text in flags.items()})
    again = plan(cfg, target="v5e-1")
    assert again["fits"] and again["compiled_bytes_per_device"] == best["compiled_bytes_per_device"]
    assert cfg.train.global_batch_size == 640 and cfg.model.d_model == 256  # the same model and batch


ALLOCATOR_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                       "XLA_PYTHON_CLIENT_ALLOCATOR")  # fmt: skip


def test_chips_are_told_apart_by_their_device_kind_and_gpus_judged_by_what_jax_lets_a_process_hold(monkeypatch):
    assert [chip_of(k) for k in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "TPU v5", "TPU v5 lite",
                                 "NVIDIA H100 NVL", "NVIDIA H100")] == [  # fmt: skip
        "h100", "h100-pcie", "h200", "tpu-v5p", "tpu-v5e", None, None]  # fmt: skip
    assert CHIPS["h100-pcie"].peak_flops < CHIPS["h100"].peak_flops  # 756 against 989 dense bf16 TFLOP/s
    # The share against jaxlib's own reading of the same variables (the plugin's default is 0.75).
    from jaxlib.xla_client import generate_pjrt_gpu_plugin_options

    for setting in ({}, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"},
                    {"XLA_CLIENT_MEM_FRACTION": ".5", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}):  # fmt: skip
        for name in ALLOCATOR_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in setting.items():
            monkeypatch.setenv(name, value)
        share = generate_pjrt_gpu_plugin_options().get("memory_fraction", 0.75)
        assert CHIPS["h100"].usable_hbm_bytes == int(80e9 * share), setting
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    assert CHIPS["h100"].usable_hbm_bytes == 80e9 and CHIPS["tpu-v5e"].usable_hbm_bytes == int(15.75 * 2**30)


@needs_cuda_plugin
def test_h100_hosts_compile_without_a_gpu(monkeypatch):
    assert parse_target("h100-16").topology == "1x2x8" and parse_target("h200-4").topology == "1x1x4"
    two_hosts = target_devices(parse_target("h100-16"))
    assert len(two_hosts) == 16 and {d.process_index for d in two_hosts} == {0, 1}
    for name in ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    result = plan(bf16_model(), target="h100-8")
    assert chip_of(result["device_kind"]) == "h100" and result["fits"]
    assert result["hbm_bytes_per_device"] == 80 * 10**9 and result["usable_hbm_bytes_per_device"] == 60 * 10**9
    assert "75%" in result["usable_hbm_because"]
    assert result["cost"]["flops"] == pytest.approx(result["flops_per_step"] / result["devices"], rel=0.02)
    # XLA:GPU combines a layer's gathers (and scatters) into one async collective of many arrays.
    measured, textbook = result["collectives"]["measured"], result["collectives"]["textbook"]
    for kind in ("all-gather", "reduce-scatter"):
        assert measured[kind]["sent"] == pytest.approx(textbook[kind], rel=0.1), kind
    # cuDNN's attention compiles only where cuDNN's library is: elsewhere one sentence, before any compile.
    fused = with_changes(bf16_model(), {"model.attention": "auto"})
    if cudnn_missing():
        with pytest.raises(
            ConfigError,
            match=r"h100-8 with cuDNN's fused attention \(model.attention=auto\) needs "
            r"cuDNN's library, which this machine lacks: plan with --config.model.attention=xla",
        ):
            plan(fused, target="h100-8")
        assert plan(fused, target="h100-8", compile_step=False)["devices"] == 8  # the arithmetic needs none


@pytest.mark.slow  # two TPU compiles, ~60 s and ~150 s here
@needs_libtpu
@pytest.mark.parametrize("config, target", [("gemma3_1b", "v5e-8"), ("deepseek_16b", "v5p-32")])
def test_the_model_family_configs_plan_within_the_stated_error_of_their_tpu_compiles(config, target):
    """Gemma 3 1B at 8192 tokens (local layers through splash's local mask) and the DeepSeek-V3-style 16B
    (latent attention, sigmoid-routed experts over mesh.expert, one MTP module), each compiled by XLA:TPU for
    its slice: it fits, the arithmetic's memory per device is within its stated 35% of the compiled heap,
    and the compiled step's FLOPs (remat's recomputation and the kernels' counted blocks included) lie
    between the model FLOPs the formula counts and 1.5 x them."""
    out = subprocess.run([sys.executable, "scripts/plan.py", "--config", f"configs/{config}.py", "--target", target,
                          "--json"], cwd=REPO, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    compiled, planned = result["compiled_bytes_per_device"], result["bytes_per_device"]["total"]
    assert result["fits"] and abs(planned - compiled) / compiled < 0.35, (planned, compiled)
    per_device = result["flops_per_step"] / result["devices"]
    assert per_device <= result["cost"]["flops"] <= 1.5 * per_device, (per_device, result["cost"]["flops"])


@needs_libtpu
def test_libtpus_checker_compiles_on_chosen_steps_with_the_chips_own_flags_and_is_one_sentence_off_a_tpu(tmp_path):
    """train.sdc_check_every: plan.py --target compiles the checked program beside the step, with the megacore
    check on a v5p (libtpu refuses an option it does not know, so each flag named is one it takes), and the
    program differs from the step's; a run on the CPU is refused before anything is written."""
    from trainer.run.loop import train

    cfg = micro_config(train=dict(sdc_check_every=50))
    checker = plan(cfg, target="v5p-8")["sdc_checker"]
    assert checker["flags"] == {"xla_tpu_enable_sdc_checker": True, "xla_tpu_sdc_check_repeat_count": 1,
                                "xla_tpu_sdc_check_halt_on_detection": True,
                                "xla_tpu_sdc_checker_alternate_megacore_cores": True}  # fmt: skip
    assert checker["every"] == 50 and checker["differs_from_step"] and checker["compiled_bytes_per_device"] > 0
    with pytest.raises(ConfigError, match=r"train.sdc_check_every=50 runs libtpu's silent-data-corruption checker, "
                                          r"which only a TPU has, and this run is on cpu; set it to 0"):  # fmt: skip
        train(cfg, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
