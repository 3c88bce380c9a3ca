"""The roofline's physics, each term against a number derived by hand: the routed experts a
step's tokens touch, quantized weight bytes, the format's tensor-core peak, tensor parallel's
all-reduce latency."""

import math

import pytest

from kvsim.assemble import cost_inputs
from kvsim.config import parse_scenario
from kvsim.cost.comm import AllReduce
from kvsim.cost.roofline import RooflineCost


def scenario(model: str, hardware: str = "h100-sxm", tp: int = 1, cost=None, engine=None,
             **model_keys):
    return parse_scenario({
        "model": {"preset": model, **model_keys}, "hardware": {"preset": hardware},
        "engine": {"tensor_parallel_size": tp, "max_model_len": 4096, "num_gpu_blocks": 1000,
                   **(engine or {})},
        # memory-bound or compute-bound by construction: no overhead, full efficiencies
        "cost": {"step_overhead_s": 0.0, "compute_efficiency": 1.0, "bandwidth_efficiency": 1.0,
                 "moe_compute_efficiency": 1.0, "attention_bandwidth_efficiency": 1.0,
                 "step_overhead_per_request_s": 0.0, **(cost or {})}})


def test_a_decode_step_reads_only_the_experts_its_tokens_touch():
    sc = scenario("gpt-oss-120b")
    m = sc.model
    cost = RooflineCost(cost_inputs(sc))
    bw = sc.hardware.mem_bandwidth_bytes_per_s
    dense = m.weight_bytes - m.routed_expert_bytes
    # One token at no context: top-4 of 128 experts per layer, 4/128 of the experts' bytes
    # (KV: 2 tokens' worth is below a microsecond).
    one = cost.step_time_s([(1, 0)], 1)
    assert one == pytest.approx((dense + m.routed_expert_bytes * 4 / 128) / bw, rel=1e-3)
    # Eight tokens: 1 - (1 - 4/128)^8 of them.
    eight = cost.step_time_s([(1, 0)] * 8, 8)
    assert eight == pytest.approx((dense + m.routed_expert_bytes * (1 - (124 / 128) ** 8)) / bw,
                                  rel=1e-3)
    assert one < 0.2 * m.weight_bytes / bw  # not every expert's weights, as before


def test_quantized_weight_bytes_by_hand():
    # Llama-3.1-70B: 70,553,706,496 parameters; embeddings and LM head 2 x 128,256 x 8,192 =
    # 2,101,346,304 stay BF16; FP8 (ModelOpt) 1 byte for the rest, NVFP4 4.5 bits.
    fp8 = scenario("llama-3.1-70b", quantization="modelopt").model
    assert fp8.weight_bytes == 2_101_346_304 * 2 + (70_553_706_496 - 2_101_346_304)
    fp4 = scenario("llama-3.1-70b", quantization="modelopt_fp4").model
    assert fp4.weight_bytes == 2_101_346_304 * 2 + int((70_553_706_496 - 2_101_346_304) * 4.5 / 8)


def test_fp8_weights_run_at_the_fp8_peak():
    bf16 = scenario("llama-3.1-70b")
    fp8 = scenario("llama-3.1-70b", quantization="modelopt")
    chunk = [(8192, 0)]  # a compute-bound prefill
    t16 = RooflineCost(cost_inputs(bf16)).step_time_s(chunk, 1)
    t8 = RooflineCost(cost_inputs(fp8)).step_time_s(chunk, 1)
    m = bf16.model
    linear = 2 * (m.num_params - m.embedding_params) * 8192
    # The linear layers' share halves (H100: 989.4 vs 1978.9 TFLOP/s); attention stays BF16.
    assert t16 - t8 == pytest.approx(linear / 989.4e12 - linear / 1978.9e12, rel=1e-3)
    # A GPU with no FP8 tensor cores (A100) runs them at its BF16 peak.
    a100 = scenario("llama-3.1-70b", hardware="a100-80gb", tp=4, quantization="modelopt")
    assert cost_inputs(a100).peak_fp8_flops_per_s is None


def test_tensor_parallel_all_reduce_latency_grows_with_log2_of_the_gpus():
    for tp, hops in ((2, 1), (4, 2), (8, 3)):
        inp = cost_inputs(scenario("llama-3.1-70b", tp=tp))
        ar = AllReduce(inp)
        assert ar.fixed_s == pytest.approx(hops * inp.interconnect_latency_s)
        # one token, one layer: two all-reduces of 8192 x 2 bytes, 2(P-1)/P of them per link
        assert ar.time_s(1, 1) == pytest.approx(
            2 * (hops * inp.interconnect_latency_s
                 + 2 * (tp - 1) / tp * 8192 * 2 / inp.interconnect_bandwidth_bytes_per_s))
    assert math.ceil(math.log2(8)) == 3


def test_kv_reads_at_the_attention_bandwidth():
    # Llama-3.1-8B BF16 decode, 32 requests at 4,095 tokens of context: weights at full
    # bandwidth, 32 x 4,096 tokens of KV (32 layers x 8 heads x 128 x 2 x 2 bytes = 131,072
    # per token) read, 32 x 1 written, at half of it.
    sc = scenario("llama-3.1-8b", cost={"attention_bandwidth_efficiency": 0.5})
    m, bw = sc.model, sc.hardware.mem_bandwidth_bytes_per_s
    t = RooflineCost(cost_inputs(sc)).step_time_s([(1, 4095)] * 32, 32)
    kv = 131_072 * (32 * 4096 + 32)
    assert t == pytest.approx(m.weight_bytes / bw + kv / (0.5 * bw), rel=1e-9)


@pytest.mark.parametrize("is_async", [False, True])
def test_per_request_cpu_time_adds_or_overlaps(is_async):
    # 64 decodes of Llama-3.1-8B at no context: the GPU reads the weights (about 4.8 ms on an
    # H100); the CPU spends 0.1 ms per request, 6.4 ms: added without async scheduling, the
    # longer of the two with it; the fixed overhead is added either way.
    sc = scenario("llama-3.1-8b", cost={"step_overhead_per_request_s": 1e-4,
                                        "step_overhead_s": 1e-3},
                  engine={"async_scheduling": is_async})
    bw = sc.hardware.mem_bandwidth_bytes_per_s
    gpu = RooflineCost(cost_inputs(scenario("llama-3.1-8b"))).step_time_s([(1, 0)] * 64, 64)
    assert gpu == pytest.approx(sc.model.weight_bytes / bw, rel=2e-3)  # + 64 tokens of KV
    t = RooflineCost(cost_inputs(sc)).step_time_s([(1, 0)] * 64, 64)
    cpu = 64 * 1e-4
    assert t == pytest.approx(1e-3 + (max(gpu, cpu) if is_async else gpu + cpu), rel=1e-12)


def test_the_label_says_where_the_constants_come_from():
    def label(hardware, cost=None):
        sc = parse_scenario({"model": {"preset": "llama-3.1-8b"}, "hardware": {"preset": hardware},
                             "engine": {"max_model_len": 4096}, "cost": cost or {}})
        return RooflineCost(cost_inputs(sc)).label

    assert label("h100-sxm") == "roofline (fitted for Hopper)"
    assert label("a100-80gb") == "roofline (uncalibrated)"  # no Ampere table
    assert label("h100-sxm", {"compute_efficiency": 0.5}) == "roofline ([cost] constants)"
