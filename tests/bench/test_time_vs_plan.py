"""bench/time_vs_plan: its rewrite of the CPU description keeps the measured figures and holds one efficiency block."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import time_vs_plan  # noqa: E402

from hybridrl.config.hardware import load_hardware  # noqa: E402

MEASURED = """\
# measured by `hybridrl hardware --measure --ranks 2`
name: 'a CPU, 1 of 2 rank(s)'
bf16_tflops: 0.003
fp32_tflops: 0.12
memory_gb_per_s: 40.0
intra_node_gb_per_s: 2.5
inter_node_gb_per_s: 2.5
host_gb_per_s: 40.0
link_latency_us: 250.0
efficiency:
  # the link and a streaming read at the rates measured above (not datasheet peaks)
  link: 1.0
  stream_memory: 1.0
"""


def test_the_fit_rewrites_the_descriptions_fitted_part_after_its_measured_one(tmp_path):
    """A freshly measured description (with the efficiency block `hybridrl hardware --measure` writes) and one the
    bench already fitted (the old fit after it) both come out as the measured figures plus this fit, one
    efficiency block holding the measured link and stream rates and the fitted fractions."""
    fit = {"decode_step_ms": 3.5, "layer_pass_ms": 2.5, "sync_tensor_ms": 0.6, "update_matmul": 1.7,
           "forward_matmul": 1.7, "prefill_matmul": 1.7, "decode_memory": 0.2, "optimizer_memory": 0.2}
    description = tmp_path / "cpu.yaml"
    for before in (MEASURED, MEASURED.split("efficiency:")[0] + time_vs_plan.FITTED_HEADER + "decode_step_ms: 9\n"
                   "efficiency:\n  link: 1.0\n  stream_memory: 1.0\n  update_matmul: 9\n"):
        description.write_text(before)
        time_vs_plan.write_description(description, fit)
        text = description.read_text()
        assert text.count("efficiency:") == 1 and text.count("# fitted by") == 1, text
        hardware = load_hardware(str(description))
        assert (hardware.fp32_tflops, hardware.memory_gb_per_s, hardware.link_latency_us) == (0.12, 40.0, 250.0)
        assert (hardware.decode_step_ms, hardware.layer_pass_ms, hardware.sync_tensor_ms) == (3.5, 2.5, 0.6)
        assert (hardware.efficiency.link, hardware.efficiency.stream_memory) == (1.0, 1.0)
        assert (hardware.efficiency.update_matmul, hardware.efficiency.decode_memory) == (1.7, 0.2)
