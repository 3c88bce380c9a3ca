#!/usr/bin/env python3
"""The KV-cache layout vLLM builds for a model, computed by vLLM's own engine path on CPU.

Standalone: imports only vllm, torch and the standard library, never kvsim. Run it with an
oracle environment's interpreter (kvsim/oracle/make_env.sh):

    ~/.cache/kvsim/oracle/vllm-0.33.0/bin/python kvsim/oracle/layout_driver.py < in.json

Input (stdin, one JSON object; null or absent = vLLM's default):
  config_dir            folder holding config.json (no weights, no tokenizer needed)
  tensor_parallel_size  default 1
  device_capability     [major, minor] of the GPU modelled, default [9, 0]
  device_name           default "NVIDIA H100 80GB HBM3"
  total_memory_bytes    default 85045477376 (80 GiB class)
  kv_cache_dtype        "auto" | "fp8" | ...
  block_size            --block-size (null: the backend/hybrid resolution decides)
  enable_prefix_caching
  mamba_cache_mode      "none" | "align" | "all"
  max_model_len
  kv_cache_memory_bytes the KV-cache memory per worker (vLLM's --kv-cache-memory-bytes);
                        default 10 GiB
  speculative_config    dict passed to EngineArgs(speculative_config=...), e.g.
                        {"method": "mtp", "num_speculative_tokens": 1}; the draft's own
                        layers are not built (see notes)
  language_model_only   bool (default true for multimodal architectures where the release
                        has EngineArgs.language_model_only, else limit_mm_per_prompt = 0)

Output (stdout, one JSON object): vllm_version, block_size (cache_config.block_size after
the engine's resolution), mamba_block_size, mamba_cache_mode, num_blocks (KVCacheConfig
.num_blocks for kv_cache_memory_bytes), groups (one per KVCacheGroupSpec: kind, spec_class,
block_size, sliding_window, num_layers, page_size_bytes per layer, layer_names, and a few
spec fields), kv_cache_tensors (size, shared_by_count), hash_block_size, num_params (numel
of the meta-built model), dtype, attention_backends, notes. On failure: {"error": ...} and
exit status 1.

The path (mirrors what `vllm serve` runs, release by release):
  1. EngineArgs(model=config_dir, skip_tokenizer_init=True, load_format="dummy",
     enforce_eager=True, ...).create_engine_config()   (0.19: the hybrid block raise runs
     here, in the model config's verify_and_update_config)
  2. init_distributed_environment (gloo, world size 1) + initialize_model_parallel(1) under
     set_current_vllm_config, as
     the GPU worker's init_device does; for TP > 1 the TP group coordinator is told it has
     tensor_parallel_size ranks and is rank 0 (patch P5), so rank 0's shards are built.
  3. The model class, built the way the model loader does (BaseModelLoader.create_model ->
     initialize_model) under set_current_vllm_config, set_default_torch_dtype(model dtype)
     and torch.device("meta") (the worker builds it on "cuda"; meta tensors take no memory).
     Each attention layer picks its backend with vLLM's own selector for the capability
     modelled and registers itself in compilation_config.static_forward_context.
  4. current_platform.update_block_size_for_backend(vllm_config) where the release has it
     (the executor runs it after load_model: the backend block size and, for hybrid
     models, _align_hybrid_block_size).
  5. GPUModelRunner.get_kv_cache_spec (the release's own method, called on a stand-in
     runner holding vllm_config), then EngineCore._initialize_kv_caches' steps:
     resolve_kv_cache_layout (0.33), get_global_kv_cache_groups / get_kv_cache_configs /
     generate_scheduler_kv_cache_config (0.33) or get_kv_cache_config (older), the worker's
     available memory being kv_cache_memory_bytes (as Worker.determine_available_memory
     returns it when --kv-cache-memory-bytes is set), then cache_config.block_size = the
     smallest prefix-cacheable group block size, and resolve_kv_cache_block_sizes.

Patches (device queries, import-time plumbing and process-group sizes; none to vLLM's
planning logic). Each one applied is listed in the output's "notes":
  P1  The wheel's CUDA extension modules (vllm/_C_stable_libtorch, _moe_C..., vllm_flash_attn/
      _vllm_fa2_C/_vllm_fa3_C, ...) cannot be dlopened without libcuda.so.1; each such module
      is replaced by an empty module, so import-time availability checks (FA2/FA3 present)
      see what a CUDA machine with this wheel sees. vllm.cumem_allocator is left absent.
  P2  vllm.platforms.current_platform is an instance of the release's CudaPlatform
      (NonNvmlCudaPlatform: no NVML), set before anything reads it.
  P3  CudaPlatform answers for the GPU modelled: get_device_capability, get_device_name,
      get_device_total_memory, device_count -> max(8, TP), is_fully_connected -> True,
      get_current_memory_usage -> 0, current_device -> the meta device (where the model is
      built).
  P4  torch.cuda.get_device_capability / get_device_name / get_device_properties /
      is_available / device_count / current_device answer the same; torch.cuda.Stream /
      Event / current_stream are inert placeholders (a MoE layer makes an aux stream).
  P5  TP > 1: after initialize_model_parallel(1) the TP GroupCoordinator's world_size is set
      to tensor_parallel_size (rank_in_group 0): layers shard as on rank 0.
  P6  The kernel library's capability queries (ops.cutlass_scaled_mm_supports_fp8 /
      _block_fp8 / _fp4, cutlass_group_gemm_supported) answered in Python as csrc answers
      them for a CUDA >= 12.8 build (quantized-GEMM / MoE kernel choice only).
  P7  Only without a real Triton: vllm.config.vllm.HAS_TRITON = True (Model Runner V2 choice).
  P8  torch.ops namespaces of the stubbed libraries hand out a placeholder for any op they lack
      (layers take op handles such as torch.ops._C.silu_and_mul when built); calling one
      raises. Installed after vllm._custom_ops is imported (its hasattr guards see the truth).
  P9  The model registry's inspection subprocess (registry._run_in_subprocess, there to keep
      CUDA out of the engine process) runs in-process, with these patches.
  P10 triton.runtime.driver.active answers for the GPU modelled (target cuda/<capability>,
      device properties): flash_linear_attention's module-level platform checks read it.
  P11 torchvision (PyPI's CUDA build; its _C cannot load on CPU torch): the torchvision::nms /
      qnms schemas it registers fakes for at import are declared first.
  P12 While the model is built and update_block_size_for_backend runs, tensors created on an
      explicit CUDA device (FlashInfer per-layer workspace, CUTLASS MLA module workspace) are
      created on the meta device.
  P13 DeepSeek Sparse Attention's indexer layer sees DeepGEMM (a separate GPU kernel package)
      present, so the model builds; its KV-cache spec does not depend on it.
  P14 The worker's workspace manager (which sparse MLA layers reserve from when built) is
      started on the meta device, as GPUModelRunner starts it on the GPU.
  Any further patch a release needs is appended to "notes".
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Pure-Python dependencies of the vLLM wheel that the oracle environments (make_env.sh) leave
# out but the model-building path imports: compressed-tensors (quantization configs) and
# flashinfer-python (the FlashInfer attention backends' import-time checks). They live beside
# the environment, installed with the release's own pins by make_layout_extras.sh (with
# triton and torchvision, see P10 and P11). KVSIM_LAYOUT_EXTRAS overrides the folder. Without
# it, a model that imports them fails, and FlashInfer backends are reported unavailable by
# vLLM's selector.
EXTRAS_DIR = os.environ.get("KVSIM_LAYOUT_EXTRAS") or (sys.prefix.rstrip("/") + "-layout-extras")
if os.path.isdir(EXTRAS_DIR):
    sys.path.append(EXTRAS_DIR)

DEFAULTS = {
    "config_dir": None,
    "tensor_parallel_size": 1,
    "device_capability": [9, 0],
    "device_name": "NVIDIA H100 80GB HBM3",
    "total_memory_bytes": 85045477376,
    "kv_cache_dtype": "auto",
    "block_size": None,
    "enable_prefix_caching": True,
    "mamba_cache_mode": None,
    "max_model_len": 8192,
    "kv_cache_memory_bytes": 10 * 1024**3,
    "speculative_config": None,
    "language_model_only": None,
}

NOTES: list[str] = []


# --------------------------------------------------------------------------- patches
def _install_platform(inp: dict):
    """P1-P4: make vLLM's current platform the CUDA platform of the GPU modelled."""
    import importlib.util
    import types

    import torch

    cap = tuple(int(x) for x in inp["device_capability"])
    name = str(inp["device_name"])
    total = int(inp["total_memory_bytes"])
    tp = int(inp["tensor_parallel_size"] or 1)
    ndev = max(8, tp)

    # P1: the wheel's CUDA extension modules (vllm/*.so, vllm/vllm_flash_attn/*.so, ...) need
    # libcuda.so.1. Each one that fails to load for that reason is replaced by an empty module,
    # so the import-time availability checks see what a CUDA machine with this wheel sees
    # (e.g. FA2/FA3 present). None of their ops ever runs: the model is never executed.
    import vllm as _vllm_pkg

    root = os.path.dirname(_vllm_pkg.__file__)
    stubbed = []
    for dirpath, _dirs, files in os.walk(root):
        for fn in sorted(files):
            if not fn.endswith(".so"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fn), os.path.dirname(root))
            mod = rel.split(".")[0].replace(os.sep, ".")
            if mod in sys.modules:
                continue
            if mod == "vllm.cumem_allocator":
                # The sleep-mode allocator: left unimportable, so vllm.device_allocator.cumem
                # reports it unavailable instead of reaching for libcudart (0.19/0.22 at TP > 1).
                continue
            try:  # dlopen the file alone (importing its package would run package code early)
                spec = importlib.util.spec_from_file_location(mod, os.path.join(dirpath, fn))
                importlib.util.module_from_spec(spec)
            except Exception as e:  # noqa: BLE001
                msg = str(e)
                if any(x in msg for x in ("libcuda", "libc10_cuda", "libnvrtc", "CUDA")):
                    sys.modules[mod] = types.ModuleType(mod)
                    stubbed.append(mod)
                else:
                    NOTES.append(f"P1: {mod} failed to import ({type(e).__name__}: {msg[:120]}); left absent")
    if stubbed:
        NOTES.append("P1: CUDA extension modules not loadable without libcuda.so.1, replaced by "
                     "empty modules: " + ", ".join(stubbed))

    # P11: torchvision (a CUDA build from PyPI: its _C cannot load on CPU torch) registers
    # fake kernels for torchvision::nms / qnms at import, unguarded; their schemas are declared
    # first so that the import (transformers' image processors, which multimodal model
    # modules import) succeeds. No torchvision op runs.
    import importlib.util as _ilu

    if _ilu.find_spec("torchvision") is not None:
        try:
            _tv_lib = torch.library.Library("torchvision", "DEF")
            _tv_lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _tv_lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            globals()["_TV_LIB"] = _tv_lib
            NOTES.append("P11: torchvision::nms/qnms schemas declared before torchvision's import")
        except Exception as e:  # noqa: BLE001
            NOTES.append(f"P11 not applied: {type(e).__name__}: {e}")

    # P4: torch.cuda answers for the GPU modelled (some checks bypass the platform).
    class _Props:
        def __init__(self):
            self.name = name
            self.major, self.minor = cap
            self.total_memory = total
            self.multi_processor_count = 132
            self.gcnArchName = ""
            self.L2_cache_size = 50 * 1024 * 1024
            self.uuid = "GPU-00000000-0000-0000-0000-000000000000"

    torch.cuda.get_device_capability = lambda device=None: cap
    torch.cuda.get_device_name = lambda device=None: name
    torch.cuda.get_device_properties = lambda device=None: _Props()
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: ndev
    torch.cuda.current_device = lambda: 0

    # CUDA streams/events that layers create when built (e.g. the MoE shared-expert aux
    # stream) are inert placeholders: nothing is ever launched on them.
    class _Stream:
        def __init__(self, *a, **k):
            self.device = torch.device("cuda", 0)

        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return lambda *a, **k: None

    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Stream
    torch.cuda.current_stream = lambda device=None: _Stream()

    # P10: Triton's active driver (whose NVIDIA driver needs libcuda.so.1) answers its
    # device queries for the GPU modelled: target ("cuda", capability, warp 32), device 0,
    # device properties. Module-level checks read them (e.g. flash_linear_attention's
    # get_available_device / is_nvidia_hopper); no kernel is ever compiled or launched.
    try:
        import triton  # noqa: F401
        from triton.runtime import driver as _tdriver

        class _TritonDriver:
            def __init__(self):
                from triton.backends.compiler import GPUTarget

                self._target = GPUTarget("cuda", cap[0] * 10 + cap[1], 32)
                self.utils = types.SimpleNamespace(get_device_properties=lambda i=0: {
                    "max_shared_mem": 232448 if cap[0] >= 9 else 166912,
                    "multiprocessor_count": 132, "max_num_regs": 65536,
                    "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000,
                    "mem_bus_width": 5120})

            def is_active(self):
                return True

            def get_current_target(self):
                return self._target

            def get_current_device(self):
                return 0

            def get_current_stream(self, device=None):
                return 0

            def get_active_torch_device(self):
                return torch.device("cuda", 0)

            def get_device_interface(self):
                return torch.cuda

        _tdriver.set_active(_TritonDriver())
        NOTES.append("P10: triton.runtime.driver.active answers for the GPU modelled")
    except ImportError:
        NOTES.append("Triton not installed: vLLM uses its Triton placeholders")

    import vllm.platforms as platforms
    from vllm.platforms import cuda as cuda_mod
    from vllm.platforms.interface import DeviceCapability

    if getattr(platforms, "_current_platform", None) is not None:
        NOTES.append(
            f"current_platform was resolved before the patch: {platforms._current_platform!r}"
        )
    cls = cuda_mod.CudaPlatform

    # P3: the platform's device queries.
    dc = DeviceCapability(major=cap[0], minor=cap[1])
    cls.get_device_capability = classmethod(lambda c, device_id=0: dc)
    cls.get_device_name = classmethod(lambda c, device_id=0: name)
    cls.get_device_total_memory = classmethod(lambda c, device_id=0: total)
    cls.is_fully_connected = classmethod(lambda c, ids: True)
    cls.get_current_memory_usage = classmethod(lambda c, device=None: 0.0)
    # The worker's current device is where the model is built: the meta device (a layer that
    # passes device=current_platform.current_device() explicitly must not reach for CUDA).
    # (Platform.__getattr__ would forward it to torch.cuda.current_device.)
    cls.current_device = classmethod(lambda c: torch.device("meta"))
    if hasattr(cls, "device_count"):
        cls.device_count = classmethod(lambda c: ndev)
    if hasattr(cls, "get_device_uuid"):
        cls.get_device_uuid = classmethod(lambda c, device_id=0: _Props().uuid)
    if hasattr(cls, "get_device_numa_node"):
        cls.get_device_numa_node = classmethod(lambda c, device_id=0: None)
    # vllm.utils.*.cuda_device_count_stateless: the stateless device count.
    for modname in ("vllm.utils.torch_utils", "vllm.utils", "vllm.platforms.cuda"):
        mod = sys.modules.get(modname)
        if mod is None:
            try:
                mod = __import__(modname, fromlist=["x"])
            except Exception:  # noqa: BLE001
                continue
        for attr in ("cuda_device_count_stateless", "_cuda_device_count_stateless"):
            if hasattr(mod, attr):
                setattr(mod, attr, lambda *a, **k: ndev)

    # P2: the current platform is CUDA's.
    platforms._current_platform = cls()

    # P7: HAS_TRITON in vllm.config.vllm (and vllm.triton_utils) is True: a CUDA machine's torch
    # ships Triton, and VllmConfig picks Model Runner V2 only with it (0.33). Triton itself is
    # absent here; no kernel is compiled or run.
    try:
        import vllm.config.vllm as _cv

        if hasattr(_cv, "HAS_TRITON") and not _cv.HAS_TRITON:
            _cv.HAS_TRITON = True
            NOTES.append("P7: vllm.config.vllm.HAS_TRITON set True (Triton ships with CUDA torch)")
    except Exception:  # noqa: BLE001
        pass

    # P6: the kernel library's capability queries (torch.ops._C.*_supports_*), which the stub of
    # P1 cannot answer, answered in Python as vLLM's csrc answers them for a CUDA >= 12.8 build
    # (csrc/quantization/w8a8/cutlass/scaled_mm_entry.cu). They steer quantized-GEMM and MoE
    # kernel choices only, never a KV-cache spec.
    try:
        from vllm import _custom_ops as ops
    except Exception as e:  # noqa: BLE001
        NOTES.append(f"P6: vllm._custom_ops not importable ({type(e).__name__}: {e})")
        ops = None
    if ops is not None:
        answers = {
            "cutlass_scaled_mm_supports_fp8": lambda c: c >= 89,
            "cutlass_scaled_mm_supports_block_fp8": lambda c: c >= 90,
            "cutlass_scaled_mm_supports_fp4": lambda c: c >= 100,
            "cutlass_group_gemm_supported": lambda c: c >= 90,
        }
        for fname, fn in answers.items():
            if hasattr(ops, fname):
                setattr(ops, fname, (lambda f: lambda cuda_device_capability, *a, **k: bool(
                    f(int(cuda_device_capability))))(fn))

    # P9: the model registry inspects a model class in a child interpreter
    # (registry._run_in_subprocess, "to avoid initializing CUDA" in the engine process); the
    # child would have none of these patches, so the inspection runs in this process instead.
    # There is no CUDA to initialize here.
    try:
        from vllm.model_executor.models import registry as _registry

        if hasattr(_registry, "_run_in_subprocess"):
            _registry._run_in_subprocess = lambda fn: fn()
            NOTES.append("P9: model registry inspection runs in-process")
    except Exception as e:  # noqa: BLE001
        NOTES.append(f"P9 not applied: {type(e).__name__}: {e}")

    # P8: layers take handles to the kernel library's ops when they are built (e.g.
    # SiluAndMul: self.op = torch.ops._C.silu_and_mul). The CUDA build registers them; here the
    # op namespaces of the stubbed libraries (P1) hand out a placeholder for any op they lack,
    # which raises if it is ever called (it never is: nothing runs). Installed after
    # vllm._custom_ops is imported, so its hasattr(torch.ops._C, ...) guards around fake-op
    # registrations saw the real, empty namespaces.
    namespaces = {m.rsplit(".", 1)[-1] for m in stubbed}
    namespaces |= {"_C", "_C_cache_ops", "_C_cuda_utils", "_C_custom_ar", "_C_utils", "_moe_C"}
    namespaces.discard("_C_stable_libtorch")
    namespaces.discard("_moe_C_stable_libtorch")
    for ns in sorted(namespaces):
        real = getattr(torch.ops, ns)
        setattr(torch.ops, ns, _PlaceholderNamespace(ns, real))
    NOTES.append("P8: placeholder ops for torch.ops." + ", torch.ops.".join(sorted(namespaces)))

    # P13: DeepSeek Sparse Attention's indexer (SparseAttnIndexer) refuses to be built on CUDA
    # without DeepGEMM, a separate kernel package a GPU deployment installs; it is absent here,
    # and nothing runs. The indexer's KV-cache spec does not depend on it.
    try:
        import vllm.model_executor.layers.sparse_attn_indexer as _sai

        if hasattr(_sai, "has_deep_gemm") and not _sai.has_deep_gemm():
            _sai.has_deep_gemm = lambda: True
            NOTES.append("P13: SparseAttnIndexer sees DeepGEMM present")
    except Exception:  # noqa: BLE001
        pass
    # P14: the worker's workspace manager (GPUModelRunner.__init__ starts it on the GPU; sparse
    # MLA layers reserve from it when built) is started on the meta device.
    try:
        import torch as _torch
        import vllm.v1.worker.workspace as _ws

        if getattr(_ws, "_manager", "absent") is None:
            _ws.init_workspace_manager(_torch.device("meta"))
            _torch.accelerator.empty_cache = lambda: None  # nothing cached on meta
            NOTES.append("P14: workspace manager started on the meta device")
    except Exception:  # noqa: BLE001
        pass
    return platforms._current_platform


def _cuda_to_meta_mode():
    """P12: tensors a layer or backend creates on an explicit CUDA device while the model is
    built (FlashInfer's per-layer workspace counters, CUTLASS MLA's module-level workspace)
    are created on the meta device instead, like every other tensor of the meta-built model."""
    import torch
    from torch.overrides import TorchFunctionMode

    def is_cuda(d) -> bool:
        if isinstance(d, torch.device):
            return d.type == "cuda"
        if isinstance(d, str):
            return d.startswith("cuda")
        return isinstance(d, int) and not isinstance(d, bool)

    class _CudaToMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs and is_cuda(kwargs["device"]):
                kwargs["device"] = torch.device("meta")
            if func in (torch.Tensor.to, torch.Tensor.cuda):
                if func is torch.Tensor.cuda:
                    return args[0].to("meta")
                args = tuple(torch.device("meta") if is_cuda(a) else a for a in args)
            return func(*args, **kwargs)

    return _CudaToMeta()


class _PlaceholderOp:
    def __init__(self, name: str):
        self._name = name

    def __call__(self, *a, **k):
        raise RuntimeError(f"kvsim layout oracle: kernel {self._name} was called (it must not run)")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _PlaceholderOp(f"{self._name}.{attr}")


class _PlaceholderNamespace:
    def __init__(self, name: str, real):
        self._name = name
        self._real = real

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        try:
            return getattr(self._real, attr)
        except AttributeError:
            return _PlaceholderOp(f"torch.ops.{self._name}.{attr}")


def _init_distributed(tp: int):
    """One process, gloo, world size 1 (the GPU worker's init_device), then P5 for TP > 1."""
    import tempfile

    from vllm.distributed import parallel_state as ps

    fd, path = tempfile.mkstemp(prefix="kvsim-layout-dist-")
    os.close(fd)
    os.unlink(path)
    ps.init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=f"file://{path}", local_rank=0, backend="gloo"
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if tp > 1:
        grp = ps.get_tp_group()
        grp.world_size = tp  # P5
        grp.rank_in_group = 0
        NOTES.append(
            f"P5: TP group coordinator set to world_size={tp}, rank 0 (one process builds rank 0's shards)"
        )


# --------------------------------------------------------------------------- helpers
def _accepted(fn) -> set[str] | None:
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def _kind(spec) -> str:
    n = type(spec).__name__
    table = {
        "FullAttentionSpec": "full_attention",
        "SlidingWindowSpec": "sliding_window",
        "ChunkedLocalAttentionSpec": "chunked_local",
        "MambaSpec": "mamba",
        "MLAAttentionSpec": "mla",
        "CrossAttentionSpec": "cross_attention",
        "EncoderOnlyAttentionSpec": "encoder_only",
        "SinkFullAttentionSpec": "sink_full_attention",
    }
    if n in table:
        return table[n]
    if "Mamba" in n:
        return "mamba"
    if "MLA" in n:
        return "mla"
    if "Sliding" in n:
        return "sliding_window"
    return n


def _spec_summary(spec) -> dict:
    import dataclasses

    out = {}
    if dataclasses.is_dataclass(spec):
        for f in dataclasses.fields(spec):
            v = getattr(spec, f.name)
            if isinstance(v, (int, float, str, bool)) or v is None:
                out[f.name] = v
            elif isinstance(v, (tuple, list)) and all(isinstance(x, (int, str)) for x in v):
                out[f.name] = list(v)
            elif isinstance(v, (tuple, list)):
                out[f.name] = [str(x) for x in v]
            else:
                out[f.name] = str(v)
    return out


def _tensor_summary(t) -> dict:
    """0.33: KVCacheTensor(size, layers, layer_stride, block_stride, offset); older: (size, shared_by)."""
    layers = getattr(t, "shared_by", None)
    if layers is None:
        layers = getattr(t, "layers", [])
    out = {"size": int(t.size), "shared_by_count": len(layers)}
    for f in ("layer_stride", "block_stride", "offset"):
        if hasattr(t, f):
            out[f] = int(getattr(t, f))
    return out


class _StandInRunner:
    """What GPUModelRunner.get_kv_cache_spec / WorkerBase methods read from self."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.parallel_config = vllm_config.parallel_config
        self.speculative_config = vllm_config.speculative_config
        self.shared_kv_cache_layers: dict[str, str] = {}
        self.kv_sharing_fast_prefill_eligible_layers: set[str] = set()
        self.runner_only_attn_layers: set[str] = set()


# --------------------------------------------------------------------------- main path
def compute(inp: dict) -> dict:
    t0 = time.time()
    tp = int(inp["tensor_parallel_size"] or 1)
    platform = _install_platform(inp)

    import torch
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    version = str(getattr(vllm, "__version__", "unknown"))

    # 1. the engine config
    kwargs = dict(
        model=inp["config_dir"],
        skip_tokenizer_init=True,
        tensor_parallel_size=tp,
        max_model_len=inp["max_model_len"],
        enable_prefix_caching=inp["enable_prefix_caching"],
        block_size=inp["block_size"],
        kv_cache_dtype=inp["kv_cache_dtype"] or "auto",
        load_format="dummy",
        enforce_eager=True,
        kv_cache_memory_bytes=int(inp["kv_cache_memory_bytes"]),
        speculative_config=inp["speculative_config"],
        seed=0,
    )
    if inp["mamba_cache_mode"] is not None:
        kwargs["mamba_cache_mode"] = inp["mamba_cache_mode"]

    accepted = _accepted(EngineArgs) or set()
    for k in [k for k in kwargs if accepted and k not in accepted]:
        if kwargs[k] is None:
            kwargs.pop(k)
        elif k == "kv_cache_memory_bytes":
            kwargs.pop(k)
            NOTES.append("this release has no --kv-cache-memory-bytes; memory given to the planner directly")
        else:
            raise RuntimeError(f"this vLLM's EngineArgs has no {k!r}")
    for k in [k for k, v in kwargs.items() if v is None]:
        kwargs.pop(k)

    # Multimodal architectures: text only, through the release's own option.
    with open(os.path.join(inp["config_dir"], "config.json")) as f:
        raw_cfg = json.load(f)
    archs = raw_cfg.get("architectures") or []
    is_mm = any("ConditionalGeneration" in a or "VL" in a for a in archs) or "vision_config" in raw_cfg
    lmo = inp.get("language_model_only")
    if is_mm and lmo is not False:
        if "language_model_only" in accepted:
            kwargs["language_model_only"] = True
            NOTES.append("multimodal architecture: EngineArgs(language_model_only=True)")
        elif "limit_mm_per_prompt" in accepted:
            kwargs["limit_mm_per_prompt"] = {"image": 0, "video": 0, "audio": 0}
            NOTES.append("multimodal architecture: EngineArgs(limit_mm_per_prompt=0 for image/video/audio)")
    elif lmo and "language_model_only" in accepted:
        kwargs["language_model_only"] = True

    engine_args = EngineArgs(**kwargs)
    vllm_config = engine_args.create_engine_config()
    cache_config = vllm_config.cache_config
    model_config = vllm_config.model_config
    block_size_after_config = cache_config.block_size

    # 2. distributed state of one worker
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        _init_distributed(tp)

    # 3. the model, on the meta device
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    loader = get_model_loader(vllm_config.load_config)
    t_build = time.time()
    with (set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype),
          torch.device("meta"), _cuda_to_meta_mode()):
        if hasattr(loader, "create_model"):
            model = loader.create_model(vllm_config=vllm_config, model_config=model_config)
        else:
            from vllm.model_executor.model_loader.utils import initialize_model

            model = initialize_model(vllm_config=vllm_config, model_config=model_config)
    build_s = time.time() - t_build
    num_params = sum(p.numel() for p in model.parameters())

    # 4. backend block size + hybrid alignment (0.33: run by the executor after load_model)
    if hasattr(platform, "update_block_size_for_backend"):
        with _cuda_to_meta_mode():
            platform.update_block_size_for_backend(vllm_config)
    block_size_after_align = cache_config.block_size

    # 5. the worker's KV-cache specs, then the engine core's planning. The GPU worker builds
    # Model Runner V2 where vllm_config.use_v2_model_runner says so (0.33; needs Triton,
    # which P7 reports present), else V1: each has its own get_kv_cache_spec.
    runner = _StandInRunner(vllm_config)
    use_v2 = bool(getattr(vllm_config, "use_v2_model_runner", False))
    with set_current_vllm_config(vllm_config):
        if use_v2:
            from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec as v2_get_kv_cache_spec

            specs = v2_get_kv_cache_spec(vllm_config)
            NOTES.append("KV-cache specs from Model Runner V2 "
                         "(vllm/v1/worker/gpu/attn_utils.get_kv_cache_spec)")
        else:
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner

            specs = GPUModelRunner.get_kv_cache_spec(runner)
            NOTES.append("KV-cache specs from GPUModelRunner.get_kv_cache_spec (Model Runner V1)")
    kv_cache_specs = [specs]

    from vllm.v1.core import kv_cache_utils

    try:
        from vllm.v1.core import kv_cache_planning as planning
    except ImportError:
        planning = kv_cache_utils

    memory = int(inp["kv_cache_memory_bytes"])
    try:  # 0.33: Worker.determine_available_memory returns what remains after MM reservations
        from vllm.multimodal.gpu_ipc_memory import reserve_mm_ipc_gpu_memory

        m2 = reserve_mm_ipc_gpu_memory(
            memory, model_config.multimodal_config,
            getattr(vllm_config.parallel_config, "_api_process_count", 1),
        )
        if m2 != memory:
            NOTES.append(f"reserve_mm_ipc_gpu_memory left {m2} of {memory} bytes")
        memory = m2
    except ImportError:
        pass

    if getattr(cache_config, "kv_cache_layout", "set") is None:
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        from vllm.v1.worker.worker_base import WorkerBase

        layouts = WorkerBase.get_supported_kv_cache_layouts(runner)
        resolve_kv_cache_layout(vllm_config, [layouts], [s for d in kv_cache_specs for s in d.values()])

    with set_current_vllm_config(vllm_config):
        if hasattr(planning, "get_global_kv_cache_groups"):
            global_groups = planning.get_global_kv_cache_groups(vllm_config, kv_cache_specs)
            if hasattr(vllm_config, "adjust_dcp_kv_cache_interleave_size"):
                vllm_config.adjust_dcp_kv_cache_interleave_size(global_groups)
            configs = planning.get_kv_cache_configs(
                vllm_config, kv_cache_specs, [memory], global_groups
            )
            sched_cfg = kv_cache_utils.generate_scheduler_kv_cache_config(configs)
        elif hasattr(kv_cache_utils, "get_kv_cache_configs"):
            configs = kv_cache_utils.get_kv_cache_configs(vllm_config, kv_cache_specs, [memory])
            sched_cfg = (
                kv_cache_utils.generate_scheduler_kv_cache_config(configs)
                if hasattr(kv_cache_utils, "generate_scheduler_kv_cache_config")
                else configs[0]
            )
        else:
            sched_cfg = kv_cache_utils.get_kv_cache_config(vllm_config, specs, memory)
            configs = [sched_cfg]
    groups = sched_cfg.kv_cache_groups
    if groups:
        part = [g.kv_cache_spec.block_size for g in groups
                if getattr(g.kv_cache_spec, "prefix_cacheable", True)]
        cache_config.block_size = min(part or [g.kv_cache_spec.block_size for g in groups])
    hash_block_size = None
    if hasattr(kv_cache_utils, "resolve_kv_cache_block_sizes"):
        _, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(sched_cfg, vllm_config)

    worker_cfg = configs[0]
    out_groups = []
    for g in groups:
        spec = g.kv_cache_spec
        out_groups.append({
            "kind": _kind(spec),
            "spec_class": type(spec).__name__,
            "block_size": int(spec.block_size),
            "sliding_window": getattr(spec, "sliding_window", None),
            "num_layers": len(g.layer_names),
            "page_size_bytes": int(spec.page_size_bytes),
            "layer_names": list(g.layer_names),
            "spec": _spec_summary(spec),
        })
    backends = {}
    for layer in vllm_config.compilation_config.static_forward_context.values():
        get = getattr(layer, "get_attn_backend", None)
        if get is None:
            continue
        try:
            b = get()
            bn = b.get_name() if hasattr(b, "get_name") else getattr(b, "__name__", str(b))
        except Exception as e:  # noqa: BLE001
            bn = f"<{type(e).__name__}>"
        backends[bn] = backends.get(bn, 0) + 1
    return {
        "vllm_version": version,
        "block_size": int(cache_config.block_size),
        "block_size_after_engine_config": block_size_after_config,
        "block_size_after_backend_alignment": block_size_after_align,
        "hash_block_size": hash_block_size,
        "mamba_block_size": getattr(cache_config, "mamba_block_size", None),
        "mamba_cache_mode": getattr(cache_config, "mamba_cache_mode", None),
        "num_blocks": int(sched_cfg.num_blocks),
        "kv_cache_memory_bytes_given": memory,
        "groups": out_groups,
        "kv_cache_tensors": [_tensor_summary(t) for t in worker_cfg.kv_cache_tensors],
        "kv_cache_layout": str(getattr(cache_config, "kv_cache_layout", None)),
        "num_params": int(num_params),
        "dtype": str(model_config.dtype).replace("torch.", ""),
        "kv_cache_dtype": str(cache_config.cache_dtype),
        "attention_backends": backends,
        "max_model_len": int(model_config.max_model_len),
        "model_class": type(model).__name__,
        "device_capability": list(inp["device_capability"]),
        "tensor_parallel_size": tp,
        "timing_s": {"total": round(time.time() - t0, 2), "model_build": round(build_s, 2)},
        "notes": NOTES,
    }


def main() -> int:
    raw = sys.stdin.read()
    try:
        given = json.loads(raw) if raw.strip() else {}
        unknown = set(given) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown keys: {sorted(unknown)}")
        inp = dict(DEFAULTS)
        inp.update({k: v for k, v in given.items() if v is not None or k in ("block_size",)})
        for k in ("device_capability", "device_name", "total_memory_bytes", "tensor_parallel_size",
                  "kv_cache_memory_bytes", "max_model_len", "enable_prefix_caching"):
            if inp.get(k) is None:
                inp[k] = DEFAULTS[k]
        if not inp["config_dir"]:
            raise ValueError("config_dir is required")
        # vLLM's own logging goes to stderr; keep stdout for the result only.
        real_stdout = sys.stdout
        sys.stdout = sys.stderr
        try:
            out = compute(inp)
        finally:
            sys.stdout = real_stdout
    except Exception as e:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        json.dump({"error": f"{type(e).__name__}: {e}", "notes": NOTES}, sys.stdout)
        sys.stdout.write("\n")
        return 1
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
