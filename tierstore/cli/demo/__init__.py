"""The ``tierstore demo`` command: a small language model trained with a tight ``ram_budget``.

:mod:`tierstore.cli.demo.model` builds the model and its batches from the shipped
``corpus.txt``; :mod:`tierstore.cli.demo.run` trains it with ``TieredAdamW`` and,
in lockstep, with ``torch.optim.AdamW(fused=True)``, and checks that the two
loss curves are equal.
"""
