"""The execution kernel: what runs a planned step's micro-batches on a device, exactly weighted.

A step comes in as a plan step and this rank's place in it; :class:`~longpack.runtime.kernel.step_fn.StepRunner`
makes the step's CP context (its group, degree and rank, made once per group) and hands each micro-batch, or each
chain of them, to the one dispatch (dispatch.py), which picks its attention — whole documents, CP-sharded
pieces, a chain's chunk, a sharded chain's chunk — runs it through the one runner (runner.py: collate, device,
forward, the fused linear cross-entropy of head_loss.py) and, for a chain, injects the later chunks' dK/dV. A
pipeline stage (pipeline.py) hands its micro-batches to the same dispatch and decides only when each runs and
what crosses the stage boundary. Attention is one backend (varlen.py); K/V of chains live in kv_store.py.
"""
