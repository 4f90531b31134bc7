"""Launching a job: JAX's distributed runtime, device meshes, cross-process agreement,
preemption notices, run configuration and the persistent compilation cache."""
