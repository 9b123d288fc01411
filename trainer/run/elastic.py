"""A run relaunched on the hosts that still answer (scripts/launch_local.py --elastic; docs/resuming.md).

The launcher tells each process of a relaunch how many of the run's hosts it
has and why it relaunched (ENV_HOSTS "3/4", ENV_CAUSE a sentence). The run then
keeps its global batch: with fewer devices its microbatch no longer divides,
or each device would hold more sequences than the full set of hosts gave it
(more activation memory than the layout was planned for), so
`train.grad_accum_steps` grows to the least count that divides and keeps each
device's share at or under the planned one. The schedule, the data position
and the optimiser state are the checkpoint's: only the layout changes, as on
any resume onto another mesh (trainer/training/resume.py). A batch that no
accumulation can make on the devices that answer is one sentence, before
anything is written. The relaunch is an event in metrics.jsonl: its cause,
the hosts, the accumulation, and the goodput it cost (the time between the
launches and the training since the checkpoint it resumed from).
"""

from __future__ import annotations

import os

import jax

from parallelism.launcher import ENV_CAUSE, ENV_HOSTS
from parallelism.mesh import AXES, dcn_shape, resolve_shape
from trainer.config.errors import ConfigError
from trainer.config.forms import with_changes


def hosts() -> tuple[int, int] | None:
    """(hosts answering, hosts the run was launched on) under the elastic launcher, else None."""
    value = os.environ.get(ENV_HOSTS)
    if not value:
        return None
    now, planned = (int(v) for v in value.split("/"))
    return now, planned


def _data_ways(cfg, devices: int, slices: int) -> int:
    """The ways the batch splits over `devices` in `slices` slices (one host each) along mesh.dcn_data."""
    shape = dict(zip(AXES, resolve_shape(dict(cfg.mesh.items()), devices // slices), strict=True))
    return shape["data"] * slices * shape["fsdp"] * shape["expert"]


def keep_global_batch(cfg, say, devices: int = 0):
    """`cfg` with the accumulation that makes its global batch on the devices of the hosts that answer (`devices`:
    theirs, all of this run's by default). Over slices (mesh.dcn_data, one host a slice, as launch_local.py's
    processes are), a lost host is a lost slice: mesh.dcn_data becomes the slices that answer."""
    answering = hosts()
    if answering is None or answering[0] == answering[1]:
        return cfg
    now, planned = answering
    devices = devices or jax.device_count()
    t = cfg.train
    slices = 1
    if max(dcn_shape(cfg.mesh)) > 1:
        if cfg.mesh.dcn_fsdp * cfg.mesh.dcn_context != 1 or cfg.mesh.dcn_data != planned:
            raise ConfigError(
                f"an elastic run over slices takes one host a slice along mesh.dcn_data alone: mesh.dcn_data="
                f"{cfg.mesh.dcn_data}, dcn_fsdp={cfg.mesh.dcn_fsdp} and dcn_context={cfg.mesh.dcn_context} on "
                f"{planned} hosts; set mesh.dcn_data={planned} and the others to 1."
            )
        cfg, slices = with_changes(cfg, {"mesh.dcn_data": now}), now
        say(f"elastic: {now} of {planned} slices answer: mesh.dcn_data {planned} -> {now}", flush=True)
    try:
        ways = _data_ways(cfg, devices, slices)
        planned_ways = _data_ways(cfg, devices * planned // now, planned if slices > 1 else 1)
    except ConfigError as e:
        raise ConfigError(f"on the {devices} devices of the {now} hosts of {planned} that answer: {e}") from None
    share = t.global_batch_size // t.grad_accum_steps / planned_ways  # sequences per device per microbatch
    pieces = t.pipeline_microbatches
    for accum in range(t.grad_accum_steps, t.global_batch_size + 1):
        micro = t.global_batch_size // accum
        if t.global_batch_size % accum == 0 and micro % (ways * pieces) == 0 and micro / ways <= share:
            break
    else:
        raise ConfigError(
            f"the global batch of {t.global_batch_size} sequences cannot be made on the {devices} devices of the "
            f"{now} hosts of {planned} that answer: no train.grad_accum_steps divides it over their data x fsdp x "
            f"expert = {ways} ways with at most {share:g} sequences a device, as the full set had; bring the hosts "
            f"back, or relaunch with a train.global_batch_size that is a multiple of {ways * pieces}."
        )
    if accum != t.grad_accum_steps:
        say(f"elastic: {now} of {planned} hosts answer ({devices} devices): the global batch of "
            f"{t.global_batch_size} kept by train.grad_accum_steps {t.grad_accum_steps} -> {accum}",
            flush=True)  # fmt: skip
        cfg = with_changes(cfg, {"train.grad_accum_steps": accum})
    return cfg


def relaunch_event(cfg, cost: float) -> tuple[dict, str] | None:
    """(the metrics record, its console line) of a launch the elastic launcher made after a change of hosts,
    `cost` the goodput seconds it lost; None for any other launch."""
    answering, cause = hosts(), os.environ.get(ENV_CAUSE)
    if answering is None or not cause:
        return None
    event = {"event": "relaunch", "cause": cause, "hosts": answering[0], "of_hosts": answering[1],
             "devices": jax.device_count(), "grad_accum_steps": cfg.train.grad_accum_steps,
             "goodput_lost_seconds": cost}  # fmt: skip
    line = (
        f"relaunched on {answering[0]} of {answering[1]} hosts ({jax.device_count()} devices, "
        f"train.grad_accum_steps {cfg.train.grad_accum_steps}): {cause}; it cost {cost:.1f}s of goodput"
    )
    return event, line
