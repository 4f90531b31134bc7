"""The engine under a step and a loop: the jitted program and its batch staging, the
bound on executions in flight, the host's step count, ownership of states, loop outputs."""
