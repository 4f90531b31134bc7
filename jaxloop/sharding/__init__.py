"""Where arrays live on the mesh: flax's logical-axis annotations read as mesh axes and
FSDP's split of a leaf (`annotations`), for the partitioners of `jaxloop.partition`."""
