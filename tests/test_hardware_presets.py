"""Hardware presets (every GPU's numbers against its datasheet) and a GPU with no preset given to
``kvsim init --hardware`` as a TOML file or key=value pairs."""

import math
import re
import tomllib
from importlib import resources

import pytest

from kvsim import presets
from kvsim.cli import main
from kvsim.config import load_scenario, parse_scenario
from kvsim.schema import HARDWARE_KEYS

MiB = 2**20
GiB = 2**30
NAMES = presets.names("hardware")
NEW = ("b200", "b300", "gb200", "h20", "h800", "l4", "a10g", "rtx-4090", "rtx-5090", "mi300x",
       "mi325x", "mi355x")


def _raw(name):
    """The preset file as TOML reads it (``presets.load`` keeps every key, ``source`` too)."""
    with (resources.files("kvsim") / "presets" / "hardware" / f"{name}.toml").open("rb") as f:
        return tomllib.load(f)


def _hardware(name):
    return parse_scenario({"model": {"preset": "llama-3.2-1b"},
                           "hardware": {"preset": name}}).hardware


def test_the_new_presets_are_shipped():
    assert set(NEW) <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_preset_parses_and_names_only_schema_keys(name):
    raw = _raw(name)
    # A misspelt key in a preset file would be dropped silently (a preset supplies only the
    # keys the schema has): every key must be a [hardware] key, or the file's provenance.
    assert set(raw) - {"source"} <= {k.name for k in HARDWARE_KEYS} - {"preset"}
    assert raw["name"] == name and raw["device_name"] and raw["source"]
    hw = _hardware(name)
    assert re.fullmatch(r"\d{1,2}\.\d", hw.compute_capability)
    for key in ("peak_flops_per_s", "mem_bandwidth_bytes_per_s", "interconnect_bandwidth_bytes_per_s",
                "host_link_bandwidth_bytes_per_s"):
        assert getattr(hw, key) > 0, key
    # Lower precisions run at least as fast as higher ones.
    rates = [r for r in (hw.peak_flops_per_s, hw.peak_fp8_flops_per_s, hw.peak_fp4_flops_per_s)
             if r is not None]
    assert rates == sorted(rates)


# Which formats the tensor cores run natively (the key is left out where they do not):
# Ampere none of FP8/FP4; Hopper, Ada and CDNA 3 FP8; Blackwell and CDNA 4 both.
FP8_ONLY = {"h100-sxm", "h200", "h20", "h800", "l40s", "l4", "rtx-4090", "mi300x", "mi325x"}
FP8_AND_FP4 = {"b200", "b300", "gb200", "rtx-5090", "rtx-pro-6000", "mi355x"}
NEITHER = {"a100-80gb", "a10g"}


def test_the_format_table_covers_every_preset():
    assert set(NAMES) == FP8_ONLY | FP8_AND_FP4 | NEITHER


@pytest.mark.parametrize("name", NAMES)
def test_fp8_and_fp4_keys_where_the_gpu_runs_the_format(name):
    hw = _hardware(name)
    assert (hw.peak_fp8_flops_per_s is not None) == (name not in NEITHER)
    assert (hw.peak_fp4_flops_per_s is not None) == (name in FP8_AND_FP4)


# (spec-sheet GB, compute capability) of each preset, from the vendor's pages; memory_bytes is
# what CUDA/HIP reports, 1-2 % below (L4, A10G) to 8 % above (HBM sold in GiB) that.
SPEC = {"a100-80gb": (80, "8.0"), "a10g": (24, "8.6"), "b200": (180, "10.0"), "b300": (270, "10.3"),
        "gb200": (186, "10.0"), "h100-sxm": (80, "9.0"), "h20": (96, "9.0"), "h200": (141, "9.0"),
        "h800": (80, "9.0"), "l4": (24, "8.9"), "l40s": (48, "8.9"), "mi300x": (192, "9.4"),
        "mi325x": (256, "9.4"), "mi355x": (288, "9.5"), "rtx-4090": (24, "8.9"),
        "rtx-5090": (32, "12.0"), "rtx-pro-6000": (96, "12.0")}


@pytest.mark.parametrize("name", NAMES)
def test_memory_is_near_the_spec_sheet_and_the_capability_is_the_chips(name):
    hw = _hardware(name)
    gb, cc = SPEC[name]
    assert 0.97 < hw.memory_bytes / (gb * 1e9) < 1.08
    assert hw.compute_capability == cc


def test_b200_is_its_datasheet():
    hw = _hardware("b200")
    # NVIDIA Blackwell datasheet, HGX B200 per GPU, all "with sparsity": FP4 18, FP8 9, BF16 4.5 PF
    assert hw.peak_fp4_flops_per_s == 18e15 / 2
    assert hw.peak_fp8_flops_per_s == 9e15 / 2
    assert hw.peak_flops_per_s == 4.5e15 / 2
    assert hw.mem_bandwidth_bytes_per_s == 7.7e12                 # "180GB HBM3E | 7.7TB/s"
    assert hw.interconnect_bandwidth_bytes_per_s == 1.8e12 / 2    # NVLink 5: 1.8 TB/s total
    assert hw.host_link_bandwidth_bytes_per_s == 128e9 / 2        # "PCIe Gen5: 128GB/s"
    assert hw.memory_bytes == 182642 * MiB                        # torch total_memory=182642MB
    assert hw.device_name == "NVIDIA B200"


def test_gb200_and_b300_are_their_datasheets():
    gb = _hardware("gb200")
    # GB200 NVL72 per GPU, "with sparsity": FP4 20, FP8 10, BF16 5 PF; 186 GB at 8 TB/s
    assert (gb.peak_fp4_flops_per_s, gb.peak_fp8_flops_per_s, gb.peak_flops_per_s) == (
        20e15 / 2, 10e15 / 2, 5e15 / 2)
    assert gb.mem_bandwidth_bytes_per_s == 8e12
    # Estimate: nvidia-smi's 189471 MiB x B200's torch / nvidia-smi (182642 / 183359 MiB)
    assert gb.memory_bytes == round(189471 * 182642 / 183359) * MiB
    b3 = _hardware("b300")
    # Blackwell technical brief, per-GPU table, dense: FP4 14, FP8 4.5, BF16 2.25 PF
    assert (b3.peak_fp4_flops_per_s, b3.peak_fp8_flops_per_s, b3.peak_flops_per_s) == (
        14e15, 4.5e15, 2.25e15)
    assert b3.memory_bytes == round(275040 * 182642 / 183359) * MiB
    assert b3.device_name == "NVIDIA B300 SXM6 AC"


def test_hopper_variants_are_their_datasheets():
    h20 = _hardware("h20")
    # HGX H20: BF16 148, FP8 296 TFLOPS as printed; 96 GB HBM3, 4.0 TB/s; NVLink 900 GB/s
    assert (h20.peak_flops_per_s, h20.peak_fp8_flops_per_s) == (148e12, 296e12)
    assert h20.mem_bandwidth_bytes_per_s == 4.0e12
    assert h20.interconnect_bandwidth_bytes_per_s == 900e9 / 2
    assert h20.memory_bytes == 97285 * MiB                        # torch total_memory=97285MB
    h800 = _hardware("h800")
    # H800 SXM: BF16 1,979 / FP8 3,958 TFLOPS with sparsity, NVLink 400 GB/s total
    assert math.isclose(h800.peak_flops_per_s, 1979e12 / 2, rel_tol=2e-4)  # whitepaper 989.4
    assert math.isclose(h800.peak_fp8_flops_per_s, 3958e12 / 2, rel_tol=2e-4)
    assert h800.interconnect_bandwidth_bytes_per_s == 400e9 / 2
    assert h800.memory_bytes == _hardware("h100-sxm").memory_bytes   # the H100's, as a proxy


def test_pcie_cards_are_their_datasheets():
    l4 = _hardware("l4")
    # L4 datasheet: FP8 485, BF16 242 TFLOPS "shown with sparsity"; 300 GB/s; PCIe Gen4 64 GB/s
    assert (l4.peak_flops_per_s, l4.peak_fp8_flops_per_s) == (242e12 / 2, 485e12 / 2)
    assert l4.mem_bandwidth_bytes_per_s == 300e9
    assert l4.interconnect_bandwidth_bytes_per_s == l4.host_link_bandwidth_bytes_per_s == 64e9 / 2
    assert l4.memory_bytes == 23570219008                         # deviceQuery on NVIDIA L4
    g = _hardware("a10g")
    assert math.isclose(g.peak_flops_per_s, 80 * 512 * 1.71e9, rel_tol=1e-3)  # 80 SMs, 1.71 GHz
    assert g.memory_bytes == 22587 * MiB
    r4 = _hardware("rtx-4090")
    # Ada whitepaper, RTX 4090, FP32 accumulate: BF16 165.2/330.4, FP8 330.3/660.6; 1008 GB/s
    assert (r4.peak_flops_per_s, r4.peak_fp8_flops_per_s) == (165.2e12, 330.3e12)
    assert r4.memory_bytes == 25386352640                         # deviceQuery, 24210 MBytes
    r5 = _hardware("rtx-5090")
    # RTX Blackwell whitepaper, RTX 5090, FP32 accumulate: BF16 209.5, FP8 419, FP4 1676 (dense)
    assert (r5.peak_flops_per_s, r5.peak_fp8_flops_per_s, r5.peak_fp4_flops_per_s) == (
        209.5e12, 419e12, 3352e12 / 2)
    assert r5.mem_bandwidth_bytes_per_s == 1.792e12
    assert r5.interconnect_bandwidth_bytes_per_s == 128e9 / 2     # PCIe Gen5 x16, no NVLink


def test_amd_presets_are_their_datasheets():
    m3 = _hardware("mi300x")
    # MI300X datasheet: BF16 1307.4, FP8 2614.9 TFLOPS dense = 304 CUs x 2048 / 4096 x 2.1 GHz
    assert math.isclose(m3.peak_flops_per_s, 304 * 2048 * 2.1e9, rel_tol=1e-4)
    assert math.isclose(m3.peak_fp8_flops_per_s, 304 * 4096 * 2.1e9, rel_tol=1e-4)
    assert m3.mem_bandwidth_bytes_per_s == 5.3e12
    assert m3.memory_bytes == 196592 * MiB == 192 * GiB - 16 * MiB   # torch on ROCm
    assert m3.interconnect_bandwidth_bytes_per_s == 7 * 128e9 / 2    # 7 IF links x 128 GB/s
    m325 = _hardware("mi325x")
    assert (m325.peak_flops_per_s, m325.peak_fp8_flops_per_s) == (m3.peak_flops_per_s,
                                                                  m3.peak_fp8_flops_per_s)
    assert m325.mem_bandwidth_bytes_per_s == 6e12
    assert m325.memory_bytes == 256 * GiB - 16 * MiB                 # estimate, MI300X's rule
    m355 = _hardware("mi355x")
    # MI355X: BF16 2.5, FP8 5.0, MXFP4 10 PF dense = 256 CUs x 4096 / 8192 / 16384 x 2.4 GHz
    for rate, per_cu in ((m355.peak_flops_per_s, 4096), (m355.peak_fp8_flops_per_s, 8192),
                         (m355.peak_fp4_flops_per_s, 16384)):
        assert math.isclose(rate, 256 * per_cu * 2.4e9, rel_tol=1e-4)
    assert m355.memory_bytes == 309220868096 == 288 * GiB - 16 * MiB   # rocm-smi VRAM total
    assert m355.interconnect_bandwidth_bytes_per_s == 7 * 153.6e9 / 2
    assert m355.compute_capability == "9.5" and m3.compute_capability == "9.4"


def test_kvsim_presets_lists_every_hardware_preset(capsys):
    assert main(["presets"]) == 0
    listed = capsys.readouterr().out.split("hardware:")[1]
    for name in NAMES:
        assert re.search(rf"^  {re.escape(name)} +{re.escape(_raw(name)['device_name'])}$",
                         listed, re.M), name


def test_the_fp8_keys_are_checked_like_peak_flops():
    base = {"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "h100-sxm"}}
    for key in ("peak_fp8_flops_per_s", "peak_fp4_flops_per_s"):
        with pytest.raises(Exception, match=rf"hardware\.{key}: must be greater than 0"):
            parse_scenario({**base, "hardware": {"preset": "h100-sxm", key: 0}})
        assert getattr(parse_scenario({**base, "hardware": {"preset": "h100-sxm", key: 3e15}})
                       .hardware, key) == 3e15
    with pytest.raises(Exception, match=r"hardware\.peak_fp16_flops_per_s: unknown key"):
        parse_scenario({**base, "hardware": {"preset": "h100-sxm", "peak_fp16_flops_per_s": 1.0}})


# -- kvsim init --hardware for a GPU with no preset ------------------------------------------


def _init(capsys, tmp_path, hardware, *words):
    out = tmp_path / "s.toml"
    code = main(["init", "--hardware", hardware, "--out", str(out), "--", "vllm", "serve",
                 *(words or ("llama-3.2-1b",))])
    return code, out, capsys.readouterr().err.strip().splitlines()


def _run(tmp_path, scenario):
    """Run the written scenario on a few of its requests; the resolved scenario's [hardware]."""
    with scenario.open("a") as f:
        f.write("\n[run]\nmax_requests = 4\n")
    assert main(["run", str(scenario), "--out", str(tmp_path / "run"), "-q"]) == 0
    return tomllib.loads((tmp_path / "run" / "scenario.resolved.toml").read_text())["hardware"]


def test_key_value_pairs_make_a_gpu_that_runs(tmp_path, capsys):
    code, out, err = _init(capsys, tmp_path, "name=my-gpu,peak_flops_per_s=1.2e15,"
                           "mem_bandwidth_bytes_per_s=5e12,memory_bytes=180e9,compute_capability=10.0")
    assert code == 0, err
    given = {"name": "my-gpu", "compute_capability": "10.0", "peak_flops_per_s": 1.2e15,
             "mem_bandwidth_bytes_per_s": 5e12, "memory_bytes": 180_000_000_000}
    assert tomllib.loads(out.read_text())["hardware"] == given   # the keys alone, no preset
    resolved = _run(tmp_path, out)
    assert {k: resolved[k] for k in given} == given
    assert "interconnect_bandwidth_bytes_per_s" not in resolved   # tp 1 needs none


def test_a_preset_with_overrides(tmp_path, capsys):
    code, out, err = _init(capsys, tmp_path, "b200,mem_bandwidth_bytes_per_s=7e12")
    assert code == 0, err
    assert tomllib.loads(out.read_text())["hardware"] == {"preset": "b200",
                                                          "mem_bandwidth_bytes_per_s": 7e12}
    hw = load_scenario(out).hardware
    assert hw.mem_bandwidth_bytes_per_s == 7e12
    assert (hw.name, hw.peak_flops_per_s, hw.memory_bytes) == ("b200", 2.25e15, 182642 * MiB)


def test_a_plain_preset_is_written_as_before(tmp_path, capsys):
    code, out, err = _init(capsys, tmp_path, "mi300x")
    assert code == 0, err
    assert tomllib.loads(out.read_text())["hardware"] == {"preset": "mi300x"}


@pytest.mark.parametrize("table_form", [False, True])
def test_a_toml_file_of_hardware_keys(tmp_path, capsys, table_form):
    spec = tmp_path / "lab-gpu.toml"
    body = ('source = "our own measurements"\ndevice_name = "Lab GPU"\n'
            "peak_flops_per_s = 4e14\nmem_bandwidth_bytes_per_s = 2e12\nmemory_bytes = 48_000_000_000\n"
            "interconnect_bandwidth_bytes_per_s = 32e9\n")
    spec.write_text("[hardware]\n" + body if table_form else body)
    code, out, err = _init(capsys, tmp_path, f"{spec},memory_bytes=40e9", "llama-3.2-1b", "-tp", "2")
    assert code == 0, err
    written = tomllib.loads(out.read_text())["hardware"]
    assert written == {"name": "lab-gpu", "device_name": "Lab GPU", "peak_flops_per_s": 4e14,
                       "mem_bandwidth_bytes_per_s": 2e12, "memory_bytes": 40_000_000_000,
                       "interconnect_bandwidth_bytes_per_s": 32e9}   # name: the file's stem
    resolved = _run(tmp_path, out)
    assert resolved["name"] == "lab-gpu" and resolved["memory_bytes"] == 40_000_000_000


def test_a_preset_file_copied_and_renamed_is_a_spec(tmp_path, capsys):
    spec = tmp_path / "my-b300.toml"
    spec.write_text("\n".join(line for line in (resources.files("kvsim") / "presets" / "hardware"
                                                / "b300.toml").read_text().splitlines()
                              if not line.startswith("name ")))
    code, out, err = _init(capsys, tmp_path, str(spec))
    assert code == 0, err
    hw = load_scenario(out).hardware
    assert hw.name == "my-b300" and hw.compute_capability == "10.3"
    assert hw.peak_fp4_flops_per_s == 14e15


@pytest.mark.parametrize("hardware, words, message", [
    ("name=x,peak_flops_per_s=1e15", (),
     "--hardware: missing memory_bytes, mem_bandwidth_bytes_per_s (a GPU with no preset needs: "),
    ("name=x,memory_bytes=80e9,mem_bandwidth_bytes_per_s=3e12", (),
     "--hardware: missing peak_flops_per_s (a GPU with no preset needs: "),
    ("name=x,memory_bytes=80e9,mem_bandwidth_bytes_per_s=3e12,peak_flops_per_s=1e15",
     ("llama-3.2-1b", "-tp", "2"), "--hardware: missing interconnect_bandwidth_bytes_per_s"),
    ("name=x,memory_bytes=80e9,mem_bandwidth_bytes_per_s=3e12,peak_flops_per_s=1e15",
     ("deepseek-v3",), "--hardware compute_capability: needed for an MLA model"),
    ("b200,peak_flop_per_s=1e15", (),
     "--hardware: peak_flop_per_s: unknown key (did you mean 'peak_flops_per_s'?)"),
    ("b200,memory_bytes=lots", (), "--hardware memory_bytes: must be a number (like 5e12), got 'lots'"),
    ("b200,memory_bytes=0", (), "--hardware memory_bytes: must be at least 1, got 0"),
    ("b200,peak_fp8_flops_per_s=-1", (), "--hardware peak_fp8_flops_per_s: must be greater than 0"),
    ("b200,compute_capability=10", (), "--hardware compute_capability: must be 'major.minor'"),
    ("b20", (), "--hardware: unknown hardware preset 'b20' (did you mean 'b200'?)"),
    ("h100", (), "--hardware: unknown hardware preset 'h100' (did you mean 'h100-sxm'?)"),
    ("b200,memory_bytes", (), "--hardware: 'memory_bytes' is not key=value"),
    ("b200,,memory_bytes=1", (), "--hardware: an empty entry in 'b200,,memory_bytes=1'"),
    ("b200,memory_bytes=1e11,memory_bytes=2e11", (), "--hardware memory_bytes: given twice"),
    ("missing/gpu.toml", (), "--hardware: no such file 'missing/gpu.toml'"),
])
def test_bad_hardware_is_a_one_line_error_naming_the_key(tmp_path, capsys, hardware, words, message):
    code, out, err = _init(capsys, tmp_path, hardware, *words)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"kvsim: error: {message}"), err
    assert not out.exists()


def test_a_bad_key_in_a_spec_file(tmp_path, capsys):
    spec = tmp_path / "gpu.toml"
    spec.write_text("memory_byte = 1\n")
    code, out, err = _init(capsys, tmp_path, str(spec))
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"kvsim: error: --hardware {spec}: memory_byte: unknown key (did you mean "
                      "'memory_bytes'?) (a file gives [hardware] keys, as a preset file does)")
