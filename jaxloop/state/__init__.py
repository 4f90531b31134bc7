"""Models and their train state: a `TrainState` built from a model and batch specs
(`model_state`, `specs`), the state half of a `Step`, and what a model sows."""
