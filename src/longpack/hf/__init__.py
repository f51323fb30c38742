"""Hugging Face integration: longpack plans as a drop-in for ``transformers.Trainer`` (public hooks only).

``LongpackTrainer`` (or ``longpack_trainer_class(trl.SFTTrainer)``) plans the training set once with any longpack
planner, over data- and context-parallel ranks, and runs every optimizer step through the same engine as
``longpack train``: the longpack attention on transformers' own model classes, the exact global target mean of the
step, one gradient reduction per step (trainer.py).
"""

from .trainer import LongpackConfig, LongpackMixin, LongpackTrainer, config_message, longpack_trainer_class

__all__ = ["LongpackConfig", "LongpackMixin", "LongpackTrainer", "config_message", "longpack_trainer_class"]
