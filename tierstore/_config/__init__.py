"""Configuration that is not the state: the tuning knobs and where their values come from.

Internal: users pass knobs as :class:`tierstore.TieredAdamW` arguments or ``TIERSTORE_*`` variables.
"""
