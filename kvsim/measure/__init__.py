"""Validation against measured runs of a real vLLM engine (``kvsim validate --against ...``).

``engine``   the local target: vLLM's CPU engine in its own environment (``make_engine_env.sh``),
             driven in-process by ``engine_driver.py``; or an OpenAI-compatible vLLM server
             (``server``), started locally from that environment or reached at a URL.
``compare``  the side-by-side table, error figures, CSV and plots any target reports with.
"""
