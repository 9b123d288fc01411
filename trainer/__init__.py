# JAX is imported here, first, without the accelerator plugins' start-up noise (parallelism/accelerators.py).
from parallelism.accelerators import import_jax

import_jax()
