"""High-level trainers (google/jaxloop's ``jaxloop.trainers`` API).

Example::

    from jaxloop.trainers import SimpleTrainer, SimpleDataLoader

    loader = SimpleDataLoader(batches)
    trainer = SimpleTrainer(MLP(), epochs=3, steps_per_epoch=50,
                            batch_spec=loader.get_batch_spec())
    outputs = trainer.train(loader)
"""

from jaxloop.trainers import (
    data_loader,
    data_preprocessor,
    simple_step,
    simple_trainer,
    trainer_utils,
    transformer_step,
)
from jaxloop.trainers.data_loader import (
    PADDING_TOKEN,
    SimpleDataLoader,
    TrainerDataLoader,
    TransformerDataLoader,
)
from jaxloop.trainers.data_preprocessor import DataPreprocessor, DataPreprocessorBuilder
from jaxloop.trainers.simple_step import SimpleStep
from jaxloop.trainers.simple_trainer import SimpleTrainer
from jaxloop.trainers.trainer_utils import CheckpointingConfig, SummaryConfig, TrainerBatchSpec
from jaxloop.trainers.transformer_step import TransformerStep

__all__ = [
    "PADDING_TOKEN",
    "CheckpointingConfig",
    "DataPreprocessor",
    "DataPreprocessorBuilder",
    "SimpleDataLoader",
    "SimpleStep",
    "SimpleTrainer",
    "SummaryConfig",
    "TrainerBatchSpec",
    "TrainerDataLoader",
    "TransformerDataLoader",
    "TransformerStep",
    "data_loader",
    "data_preprocessor",
    "simple_step",
    "simple_trainer",
    "trainer_utils",
    "transformer_step",
]
