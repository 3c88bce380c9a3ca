"""kvsim against vLLM's own Scheduler.

``vllm_driver.py`` runs inside a separate virtual environment that has vLLM (built by
``make_env.sh``) and never imports kvsim; ``replay.py`` drives kvsim's scheduler with the same
loop and compares the two results field by field.
"""
