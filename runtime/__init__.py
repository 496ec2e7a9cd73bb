"""UltraQuant's run-time side of the AOT path: find generated blobs, load and launch them.

Installed as ``ultraquant.runtime`` (the source lives in the top-level ``runtime/`` folder).
"""
