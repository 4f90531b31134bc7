"""Diagnostics: goodput and MFU, memory, compiled-program analysis, profiling,
replica integrity, the run record, the parameter table and debugging switches."""
