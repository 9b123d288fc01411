# JAX is imported here, first, without the accelerator plugins' start-up noise (trainer/accelerators.py).
from trainer.accelerators import import_jax

import_jax()
