"""A GPU's utilisation, temperature and power as the status publishes them and
``status``, ``top`` and the dashboard show them."""

from __future__ import annotations

import math

from gpuwarden.core.model import GIB
from gpuwarden.gpu.base import GpuSensors
from gpuwarden.gpu.sim import simulated_sensors
from gpuwarden.node.status import BrokerStatus, GpuStatus


def test_the_status_carries_the_sensors_and_reads_back_only_numbers() -> None:
    hot = GpuStatus("GPU-a", "H100", 80, sensors=GpuSensors(87.0, 64.0, 312.5))
    cold = GpuStatus("GPU-b", "H100", 80)
    doc = BrokerStatus(gpus=(hot, cold)).to_json()
    assert doc["gpus"][0]["sensors"] == {"util_pct": 87.0, "temp_c": 64.0, "power_w": 312.5}
    assert doc["gpus"][1]["sensors"] is None
    back = BrokerStatus.from_json(doc)
    assert back.gpus[0].sensors == hot.sensors and back.gpus[1].sensors is None
    # a published document is read with care: what is not a finite number is unknown
    forged = {"util_pct": "99", "temp_c": math.inf, "power_w": True}
    assert GpuSensors.from_json(forged) == GpuSensors(None, None, None)
    assert GpuSensors.from_json(["x"]) is None


def test_the_text_says_what_the_gpu_reports() -> None:
    assert GpuSensors(87.4, 64.0, 312.5).text() == "util 87 %  64 °C  312 W"
    assert GpuSensors(None, 40.0, None).text() == "40 °C"
    assert GpuSensors().text() == ""


def test_the_simulated_gpu_invents_plausible_values_from_what_it_holds() -> None:
    idle = simulated_sensors(0, 80 * GIB, busy=False)
    assert idle == GpuSensors(0.0, 30.0, 70.0)
    half = simulated_sensors(40 * GIB, 80 * GIB, busy=True)
    assert half.util_pct == 67.5 and half.temp_c == 63.8 and half.power_w == 495.2
    full = simulated_sensors(24 * GIB, 24 * GIB, busy=True)
    assert full == GpuSensors(100.0, 80.0, 300.0)
