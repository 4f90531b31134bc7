"""Checkpoints with orbax: state, data position and metadata saved and restored
(`checkpoint`), and the actions that save them from a loop (`checkpoint_actions`)."""
