"""flax layers whose initialiser sees another shape than the parameter's (DenseGeneral's and
Einsum's flattened kernels, nn.scan's per-layer ones) initialise under every partitioner,
with the shardings their logical annotations and the rules say; also when the user's script
runs under ``jax.set_mesh`` and ``nn.logical_axis_rules``, as modern JAX code does."""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxloop import partition
from jaxloop import step as step_lib

HEADS, HEAD_DIM, EMBED = 2, 4, 8
RULES = [("batch", "data"), ("embed", "data"), ("qkv", None), ("heads", "model"),
         ("kv", None), ("mlp", "model"), ("layers", None)]


def logical(*names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class Block(nn.Module):
    """A scanned layer: its kernel's annotation gains the 'layers' axis."""

    @nn.compact
    def __call__(self, x, _):
        return nn.relu(x @ self.param("w", logical("embed", "mlp"), (EMBED, EMBED))), None


class FusedAttention(nn.Module):
    """A fused-QKV projection, an Einsum output projection and three scanned blocks."""

    @nn.compact
    def __call__(self, x):
        qkv = nn.DenseGeneral((3, HEADS, HEAD_DIM),
                              kernel_init=logical("embed", "qkv", "heads", "kv"))(x)
        y = nn.Einsum((HEADS, HEAD_DIM, EMBED), "bthd,hde->bte",
                      kernel_init=logical("heads", "kv", "embed"))(qkv[:, :, 0])
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                         length=3, metadata_params={nn.PARTITION_NAME: "layers"})
        return jnp.mean(blocks()(y, None)[0])


class MeanStep(step_lib.Step):
    def run(self, state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: state.apply_fn({"params": p}, batch))(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}


def mesh():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


PARTITIONERS = {
    "single": lambda m: partition.SingleDevicePartitioner(),
    "data_parallel": lambda m: partition.DataParallelPartitioner(m),
    "fsdp": lambda m: partition.FSDPPartitioner(m, min_weight_size=0),
    "spmd": lambda m: partition.SPMDPartitioner(m, logical_axis_rules=RULES),
}


@pytest.mark.parametrize("users_mesh", [False, True], ids=["plain", "under_set_mesh"])
@pytest.mark.parametrize("kind", sorted(PARTITIONERS))
def test_fused_einsum_and_scanned_layers_initialise_and_train(kind, users_mesh):
    m = mesh()
    part = PARTITIONERS[kind](m)
    step = MeanStep(jax.random.key(0), FusedAttention(), optimizer=optax.sgd(0.1),
                    partitioner=part, train=True)
    user = contextlib.ExitStack()
    if users_mesh:  # the user's script: its mesh and rules around everything
        user.enter_context(jax.set_mesh(part.mesh))
        user.enter_context(nn.logical_axis_rules(RULES))
    with user:
        state = step.initialize_model([8, 3, EMBED])
        params = state.params
        assert params["DenseGeneral_0"]["kernel"].shape == (EMBED, 3, HEADS, HEAD_DIM)
        assert params["Einsum_0"]["kernel"].shape == (HEADS, HEAD_DIM, EMBED)
        assert params["ScanBlock_0"]["w"].shape == (3, EMBED, EMBED)
        specs = {name: leaf["kernel" if "kernel" in leaf else "w"].sharding.spec
                 for name, leaf in params.items()}
        if kind == "spmd":  # what the rules say
            assert specs == {"DenseGeneral_0": P("data", None, "model"),
                             "Einsum_0": P("model", None, "data"),
                             "ScanBlock_0": P(None, "data", "model")}
        elif kind == "fsdp":
            assert all("data" in spec for spec in specs.values()), specs
        else:
            assert all(spec == P() for spec in specs.values()), specs
        batch = np.ones((8, 3, EMBED), np.float32)
        trained, outputs = step(state, batch)
    assert np.isfinite(float(outputs["loss"]))
    assert int(trained.step) == 1
