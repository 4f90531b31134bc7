"""Opt-in in-step recipes (docs/features.md, "Training features")."""
