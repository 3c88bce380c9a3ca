"""kvsim's KV layouts against vLLM's own engine path, run on CPU in the oracle environments.

For each case vLLM builds its config with EngineArgs, the model on the ``meta`` device (no
weights), its KV-cache specs, groups and plan for a given KV memory (``kvsim/oracle/
layout_driver.py``), and the test compares the groups (kind, block size, layers, window), the
attention block size, the Mamba cache mode and the number of blocks with ``kvsim.layout``.
Slow (10-30 s per case): run with KVSIM_LAYOUT_ORACLE=1 (CI does). The driver needs packages
the oracle environments lack (compressed-tensors, flashinfer-python, triton, torchvision at the
release's pins): ``bash kvsim/oracle/make_layout_extras.sh 0.33.0`` installs them beside the
environment.
"""

import os

import pytest

from kvsim import presets
from kvsim.config import model_preset
from kvsim.layout import derive_layout
from kvsim.oracle import layout as oracle
from kvsim.semantics import VERSIONS

pytestmark = pytest.mark.skipif(os.environ.get("KVSIM_LAYOUT_ORACLE") != "1",
                                reason="set KVSIM_LAYOUT_ORACLE=1 (needs the oracle environments)")

MEMORY = 8 << 30
CASES = [  # (preset, release, tp, capability)
    ("llama-3.1-8b", "0.33.0", 1, (9, 0)),
    ("qwen3-8b", "0.33.0", 2, (9, 0)),
    ("qwen3-30b-a3b", "0.33.0", 1, (9, 0)),
    ("gpt-oss-20b", "0.33.0", 1, (9, 0)),
    ("gemma-3-27b-it", "0.33.0", 1, (9, 0)),
    ("ministral-8b-instruct-2410", "0.33.0", 1, (9, 0)),
    ("deepseek-v3", "0.33.0", 1, (9, 0)),
    ("deepseek-v3", "0.33.0", 1, (10, 0)),
    ("deepseek-v3.2", "0.33.0", 1, (9, 0)),  # sparse MLA: the indexer's keys share the blocks
    ("deepseek-v3.2", "0.33.0", 1, (10, 0)),
    ("deepseek-v3.2", "0.32.0", 1, (9, 0)),
    ("qwen3.5-27b", "0.33.0", 1, (9, 0)),
    ("qwen3.5-27b", "0.33.0", 1, (8, 0)),
    ("qwen3.5-27b", "0.33.0", 1, (10, 0)),
    ("qwen3.5-27b", "0.33.0", 4, (9, 0)),
    ("qwen3.5-35b-a3b", "0.33.0", 2, (9, 0)),
    ("qwen3.5-27b", "0.32.0", 1, (9, 0)),
]


@pytest.mark.parametrize("name, version, tp, cap", CASES)
def test_layout_equals_vllms(name, version, tp, cap):
    if not oracle.available(version):
        pytest.skip(f"no oracle environment for vLLM {version}")
    vllm = oracle.vllm_layout(presets.load("models", name)["config"], version=version,
                              tensor_parallel_size=tp, device_capability=cap,
                              kv_cache_memory_bytes=MEMORY, max_model_len=8192)
    model = model_preset(name)
    lay = derive_layout(model, VERSIONS[version].layout, tp=tp, kv_cache_dtype="auto",
                        block_size=None, capability=cap, enable_prefix_caching=True)
    kinds = {"full_attention": "full_attention", "sliding_window": "sliding_window",
             "mamba": "mamba", "mla": "full_attention"}
    theirs = [(kinds[g["kind"]], g["block_size"], g["num_layers"], g.get("sliding_window") or 0)
              for g in vllm["groups"]]
    # vLLM lists a sparse-attention layer's indexer cache as a layer of its own in the group.
    per_layer = 2 if model.index_head_dim else 1
    ours = ([("full_attention", lay.block_size, per_layer * model.num_hidden_layers, 0)]
            if lay.groups is None
            else [(g.kind, g.block_size, g.num_layers, g.sliding_window) for g in lay.groups])
    assert ours == theirs
    assert lay.block_size == vllm["block_size"]
    assert MEMORY // lay.block_bytes == vllm["num_blocks"]
    if any(g.kind == "mamba" for g in lay.groups or ()):
        assert lay.mamba_cache_mode == vllm["mamba_cache_mode"]
