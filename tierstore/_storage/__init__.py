"""Where the state's bytes are: the shard store (RAM and files), chunk files, transfers, the streaming pipeline.

Internal: the public extension point is :mod:`tierstore.backends`.
"""
