"""The engine under a step and a loop (its modules: CONTRIBUTING.md's layout table)."""
