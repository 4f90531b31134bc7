"""The Jaxloop guide's code cells, verbatim (../shared/seeds/004_*.txt), in order."""
# ruff: noqa

from flax import linen as nn

class CNN(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(features=32, kernel_size=(3, 3))(x)
    x = nn.relu(x)
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = nn.Conv(features=64, kernel_size=(3, 3))(x)
    x = nn.relu(x)
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.Dense(features=256)(x)
    x = nn.relu(x)
    x = nn.Dense(features=10)(x)
    return x


import os
import tensorflow as tf
import tensorflow_datasets as tfds

def mnist_datasets(batch_size, data_dir):
  def map_fn(x):
    return {
        'image': tf.cast(x['image'], tf.float32) / 255.0,
        'label': tf.cast(x['label'], tf.int32),
    }

  train_dir = os.path.join(data_dir, 'train')
  test_dir = os.path.join(data_dir, 'test')
  train_ds = (
      tfds.load('mnist', data_dir=train_dir, split='train', shuffle_files=True)
      .map(map_fn)
      .batch(batch_size, drop_remainder=True)
      .prefetch(tf.data.AUTOTUNE)
      .repeat()
  )
  eval_ds = (
      tfds.load('mnist', data_dir=test_dir, split='test', shuffle_files=False)
      .map(map_fn)
      .batch(batch_size, drop_remainder=True)
      .prefetch(tf.data.AUTOTUNE)
      .cache()
  )
  return train_ds, eval_ds


from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxloop import step as step_lib
from jaxloop import types
import optax
import tensorflow as tf

Batch = types.Batch
Output = types.Output
State = types.TrainState
Step = step_lib.Step

class MnistStep(Step):

  def begin(self, state: State, batch: Batch) -> tuple[State, Batch]:
    if isinstance(batch['image'], tf.Tensor):
      batch['image'] = batch['image'].numpy()
    if isinstance(batch['label'], tf.Tensor):
      batch['label'] = batch['label'].numpy()
    return state, batch

  def run(self, state: State, batch: Batch) -> tuple[State, Optional[Output]]:
    images, labels = batch['image'], batch['label']

    def loss_fn(params):
      logits = state.apply_fn({'params': params}, images)
      one_hot = jax.nn.one_hot(labels, 10)
      loss = jnp.mean(optax.softmax_cross_entropy(logits, one_hot))
      return loss, logits

    if self.train:
      grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
      (loss, logits), grads = grad_fn(state.params)
      state = state.apply_gradients(grads=grads)
    else:
      loss, logits = loss_fn(state.params)

    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
    return state, {'loss': loss, 'accuracy': accuracy}


from jax import sharding
from jaxloop import partition
from jax.experimental import mesh_utils

Mesh = sharding.Mesh

num_devices = len(jax.devices())
mesh = Mesh(mesh_utils.create_device_mesh((num_devices,)), ('data',))
partitioner = partition.DataParallelPartitioner(mesh=mesh, data_axis='data')


from orbax import checkpoint
from clu import metric_writers
from jaxloop import actions
from etils import epath

import tempfile

work_dir = tempfile.mkdtemp()
work_dir = epath.Path(work_dir)

ckpt_manager = checkpoint.CheckpointManager(
    work_dir / 'checkpoints',
    checkpoint.Checkpointer(checkpoint.PyTreeCheckpointHandler()),
    checkpoint.CheckpointManagerOptions(max_to_keep=3),
)
metrics_writer = metric_writers.create_default_writer(
    work_dir,
    asynchronous=False,
)

ckpt_action = actions.CheckpointAction(ckpt_manager, interval=100)
summary_action = actions.SummaryAction(metrics_writer, interval=100)


from jaxloop import eval_loop as eval_loop_lib
from jaxloop import outer_loop as outer_loop_lib
from jaxloop import train_loop as train_loop_lib
import tempfile
import tensorflow_datasets as tfds

# 1. Define model.
model = CNN()

# 2. Define train and eval datasets.
data_dir = tempfile.mkdtemp()
train_ds, eval_ds = mnist_datasets(
    batch_size=32, data_dir=data_dir
)

# 3. Define training and eval steps.
train_step = MnistStep(
    jax.random.PRNGKey(0),
    model,
    optimizer=optax.sgd(learning_rate=0.005, momentum=0.9),
    partitioner=partitioner,
    train=True,
)
eval_step = MnistStep(
    jax.random.PRNGKey(0),
    model,
    partitioner=partitioner,
    train=False,
)

# 4. Define inner loops.
train_loop = train_loop_lib.TrainLoop(
    train_step, end_actions=[summary_action, ckpt_action]
)
eval_loop = eval_loop_lib.EvalLoop(eval_step, end_actions=[summary_action])

# 5. Define and invoke outer loop.
outer_loop = outer_loop_lib.OuterLoop(
    train_loop=train_loop, eval_loops=[eval_loop]
)
state, outputs = outer_loop(
    train_step.initialize_model([1, 28, 28, 1]),
    train_dataset=train_ds.as_numpy_iterator(),
    train_total_steps=100,
    train_loop_steps=10,
    eval_specs=[
        outer_loop_lib.EvalSpec(
            dataset=tfds.as_numpy(eval_ds), num_steps=100
        )
    ],
)
