"""Where arrays live on the mesh, for the partitioners of `jaxloop.partition`: flax's
logical-axis annotations read as mesh axes and FSDP's split of a leaf (`annotations`), and a
batch split along the data axis (`batches`)."""
