"""The runtime: Plans executed with PyTorch, in two rooms (imported only on demand; the core never imports torch).

* :mod:`longpack.runtime.kernel` runs one planned step's micro-batches on a device: the dispatch (documents,
  CP-sharded pieces, chains, sharded chains), the one runner, the one attention backend, the fused loss, FSDP2's
  step synchronisation and pipeline stages.
* :mod:`longpack.runtime.run` is a training run around it: arguments, rows and plan, the loop, logs, checkpoints,
  launch, the dry run; it calls the kernel's :class:`~longpack.runtime.kernel.step_fn.StepRunner` and nothing
  deeper. ``longpack.runtime.dist`` (process group, ``leave``) serves both. docs/EXECUTION.md draws the path of one
  micro-batch through them.
"""
