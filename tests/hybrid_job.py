"""The digits job under HSDP, run as real processes by tests/test_hybrid.py (not a test).

``python tests/hybrid_job.py RESULT_DIR DIGITS_ARGS...`` joins the job described by the
``JAXLOOP_*`` environment (through `multihost_job`), builds the digits train state with the
``hsdp`` partitioner and reports its layout as the shardings say it (which processes hold
each shard of every parameter and optimizer-state leaf, and the state bytes per device),
then runs the digits example with DIGITS_ARGS (`multihost_job`'s ``digits`` scenario).
Results go to ``RESULT_DIR/layout-<process index>.json`` and ``result-<process index>.json``,
never to the output streams.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import multihost_job  # noqa: E402  (joins the job: before any JAX work)
import optax  # noqa: E402

from jaxloop.examples import digits  # noqa: E402


def hsdp_layout() -> dict:
    """Per split leaf, whether each process's devices hold every one of its shards (so
    gathering it never leaves the process); and the largest per-device share of the
    state's bytes."""
    part = digits.make_partitioner("hsdp")
    step = digits.DigitsStep(jax.random.key(0), digits.CNN(), optimizer=optax.adam(3e-3),
                             partitioner=part, train=True)
    state = step.initialize_model([1, 8, 8, 1])
    tree = (state.params, state.opt_state)
    split, within = 0, []
    for leaf in jax.tree.leaves(tree):
        shards = leaf.sharding.devices_indices_map(leaf.shape)
        distinct = {tuple((s.start, s.stop) for s in index) for index in shards.values()}
        if len(distinct) == 1:
            continue  # replicated (small leaf)
        split += 1
        for process in range(jax.process_count()):
            held = {tuple((s.start, s.stop) for s in index)
                    for d, index in shards.items() if d.process_index == process}
            within.append(held == distinct)
    per_device: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return {
        "mesh": dict(part.mesh.shape),
        "split_leaves": split,
        "shards_within_each_process": all(within),
        "state_bytes": sum(x.nbytes for x in jax.tree.leaves(tree)),
        "max_bytes_per_device": max(per_device.values()),
    }


def main() -> None:
    result_dir = Path(sys.argv[1])
    result_dir.mkdir(parents=True, exist_ok=True)
    layout = result_dir / f"layout-{jax.process_index()}.json"
    layout.write_text(json.dumps(hsdp_layout()))  # read after the process has exited
    sys.argv[1:] = ["digits", *sys.argv[1:]]
    multihost_job.main()


if __name__ == "__main__":
    main()
