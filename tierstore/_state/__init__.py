"""The durable state: the state directory, its manifest, commits and resume, and read-only access to it.

Internal: :class:`tierstore.TieredAdamW` opens state directories; ``tierstore inspect`` reads them.
"""
