"""Diagnostics: goodput and MFU, memory estimates from XLA, profiling,
replica integrity, the run record, the parameter table and debugging switches."""
