"""The accounting core: block pool, chained block hashes and the KV-cache manager.

Pure Python, no SimPy: every rule here can be driven and checked without a clock.
"""
