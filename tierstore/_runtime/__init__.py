"""The running machinery of an open optimizer: startup, one step's update, the step behind the loop.

Internal: :class:`tierstore.TieredAdamW` is its public face.
"""
