"""Opt-in in-step recipes: gradient accumulation, the non-finite guard, an EMA of the
parameters, mixed precision and in-step telemetry."""
