"""Device meshes and the logical-axis rules that place arrays on them."""
