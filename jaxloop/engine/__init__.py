"""The engine under a step and a loop: the jitted program and its batch staging, the
bound on executions in flight, the host's step count, loop outputs and their metric
values, and logical-axis annotations."""
