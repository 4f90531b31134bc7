"""What an `OuterLoop` composes: rounds of evaluations, continuous evaluation of a
checkpoint directory, resume bookkeeping and the STOPPED marker."""
