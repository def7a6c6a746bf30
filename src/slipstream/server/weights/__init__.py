"""Weights: where a model's files come from and where they are kept.

Sources (a model URI's ``hf://``, ``s3://``, a local path, ``builtin``; ``sim:`` has none), the
fetch that downloads them into the shared model cache (lock, leases, eviction), and the disk
cache of what is derived from a model file. :mod:`slipstream.server.models` builds networks from
what this package hands it; nothing here imports torch or the models.
"""
