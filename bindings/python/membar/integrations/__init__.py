"""membar's methods inside the Hugging Face training loops people already use.

  membar.integrations.oomb    chunk-recurrent (OOMB) steps for long sequences in ``transformers.Trainer``
                              and TRL's ``SFTTrainer``: :class:`~membar.integrations.oomb.OOMBTrainerMixin`,
                              :class:`~membar.integrations.oomb.OOMBHFTrainer`, :func:`~membar.integrations.oomb.oomb_sft_trainer`
  membar.integrations.logra   LoGRA (sketched gradients, ``LoGRAOptimizer``, predicted-KL step control)
                              in TRL's ``GRPOTrainer``: :class:`~membar.integrations.logra.LoGRAGRPOTrainer`,
                              and :class:`~membar.integrations.logra.LoGRATorchOptimizer` for any Trainer

Each module imports transformers (and TRL where named) only when it is imported itself.
"""
