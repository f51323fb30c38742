"""Hugging Face integration: longpack plans as a drop-in for ``transformers.Trainer`` (public hooks only).

``LongpackTrainer`` plans the training set once with any longpack planner, feeds each process exactly its
micro-batches of every optimizer step as packed rows (``position_ids`` restarting per document plus the
flash-attention ``cu_seq_lens_q/k`` and ``max_length_q/k`` kwargs), and computes the loss as the global token mean
of the step across gradient accumulation and processes.
"""

from .trainer import LongpackConfig, LongpackMixin, LongpackTrainer, check_document_masking, longpack_trainer_class

__all__ = ["LongpackConfig", "LongpackMixin", "LongpackTrainer", "check_document_masking", "longpack_trainer_class"]
