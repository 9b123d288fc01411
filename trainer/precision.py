"""Mixed precision: matmuls in `precision.compute_dtype`, everything else fp32, and loss scaling.

float16 has 5 exponent bits: small gradients underflow to zero. Dynamic loss
scaling multiplies the loss by a large factor before the backward pass and
divides the fp32 gradients by it afterwards; a step whose gradients overflow
is skipped and the scale halved, and after `loss_scale_growth_interval` good
steps in a row it doubles. bfloat16 has float32's exponent range and needs
none of this, which is why it is the default.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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

    def update(self, scale: jax.Array, good_steps: jax.Array, finite: jax.Array):
        """(new scale, new count of good steps in a row) after a step whose gradients were `finite`."""
        if not self.dynamic:
            return scale, good_steps
        grow = finite & (good_steps + 1 >= self.growth_interval)
        scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), jnp.maximum(scale / 2.0, 1.0))
        good_steps = jnp.where(finite & ~grow, good_steps + 1, 0)
        return scale, good_steps
