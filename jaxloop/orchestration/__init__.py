"""What an `OuterLoop` composes: rounds of evaluations, continuous evaluation of a
checkpoint directory, resume bookkeeping and the STOPPED marker."""

import logging

# OuterLoop's messages keep its logger's name, which users filter on.
log = logging.getLogger("jaxloop.outer_loop")
