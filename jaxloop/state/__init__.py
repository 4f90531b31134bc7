"""Models and their train state: the state half of a `Step`."""
