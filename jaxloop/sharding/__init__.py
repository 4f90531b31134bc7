"""Where arrays live on the mesh, for the partitioners of `jaxloop.partition`."""
