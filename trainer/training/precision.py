"""Mixed precision: matmuls in `precision.compute_dtype`, everything else fp32, and loss scaling.

float16 has 5 exponent bits: small gradients underflow to zero. Dynamic loss
scaling multiplies the loss by a large factor before the backward pass and
divides the fp32 gradients by it afterwards; a step whose gradients overflow
is skipped and the scale halved, and after `loss_scale_growth_interval` good
steps in a row it doubles. The scaled quantity is the mean loss over the
step's tokens, so the gradients' size, and the scale that fits them, do not
grow with the batch. While the scale can still fall, an overflow is the
scaler's business, not a sign of trouble (trainer/training/stability.py); at the floor
(1) it is a bad step like any other. bfloat16 has float32's exponent range and
needs none of this, which is why it is the default.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MIN_SCALE = 1.0


@dataclasses.dataclass(frozen=True)
class LossScaling:
    dynamic: bool
    initial: float
    growth_interval: int

    @classmethod
    def from_config(cls, cfg) -> LossScaling:
        p = cfg.precision
        dynamic = p.loss_scaling == "dynamic" or (p.loss_scaling == "auto" and p.compute_dtype == "float16")
        return cls(dynamic, float(p.initial_loss_scale) if dynamic else 1.0, int(p.loss_scale_growth_interval))

    def initial_state(self) -> dict:
        return {"scale": jnp.float32(self.initial), "good_steps": jnp.int32(0)}

    def update(self, state: dict, finite: jax.Array) -> dict:
        """The scale and the count of good steps in a row after a step whose gradients were `finite`."""
        if not self.dynamic:
            return state
        scale, good_steps = state["scale"], state["good_steps"]
        grow = finite & (good_steps + 1 >= self.growth_interval)
        scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), jnp.maximum(scale / 2.0, MIN_SCALE))
        return {"scale": scale, "good_steps": jnp.where(finite & ~grow, good_steps + 1, 0)}

    def overflowed(self, loss: jax.Array, grad_norm: jax.Array, scale: jax.Array) -> jax.Array:
        """True for a step whose forward pass was finite and whose scaled backward pass was not,
        while the scale can still fall: the scaler's own business, not a bad step."""
        if not self.dynamic:
            return jnp.zeros((), bool)
        return jnp.isfinite(loss) & ~jnp.isfinite(grad_norm) & (scale > MIN_SCALE)

    def resumed(self, saved: dict, saved_dynamic: bool) -> dict:
        """The scale to go on with after a resume, which may have switched precision."""
        if self.dynamic and saved_dynamic:
            return saved
        return {k: jnp.asarray(v) for k, v in self.initial_state().items()}
