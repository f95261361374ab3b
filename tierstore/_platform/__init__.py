"""What tierstore needs from torch, the OS and the process, behind one name each.

torch's private APIs (:mod:`.torch_private`), DTensor and dynamo shims, tierstore's own threads, the
process group, page-aligned and pinned host buffers, fault-injection points and ``module:attr``
specs. Internal: import the public API from :mod:`tierstore`.
"""
