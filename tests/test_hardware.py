import json

import pytest

from longpack.hardware import SKRULL_H100_TABLE, HardwareSpec, get_hardware, load_hardware
from longpack.model import UnknownNameError

MB = 2**20


def test_table_points_are_returned_exactly():
    hw = get_hardware("h100")
    for kind, rows in SKRULL_H100_TABLE.items():
        for mb, us in rows:
            assert hw.collective_s(kind, mb * MB) == pytest.approx(us * 1e-6)


def test_latency_floor_interpolation_and_extrapolation():
    hw = get_hardware("h100")
    assert hw.collective_s("all_reduce", 1) == pytest.approx(84.65e-6)  # floor
    assert hw.collective_s("all_gather", 3 * MB) == pytest.approx((53.29 + 72.52) / 2 * 1e-6)
    slope = (6467.9 - 3416.4) / 512
    assert hw.collective_s("all_gather", 2048 * MB) == pytest.approx((6467.9 + slope * 1024) * 1e-6)


def test_group_of_one_is_free_and_cross_node_is_slower():
    hw = get_hardware("h100")
    assert hw.collective_s("all_gather", 64 * MB, group=1) == 0.0
    assert hw.collective_s("all_gather", 64 * MB, group=16) > hw.collective_s("all_gather", 64 * MB, group=8)


def test_presets_differ_where_they_should():
    h100, h200, a100 = get_hardware("h100"), get_hardware("h200"), get_hardware("a100")
    assert h200.memory_gib > h100.memory_gib and h200.peak_flops == h100.peak_flops
    assert a100.peak_flops < h100.peak_flops
    assert a100.collective_s("all_gather", 256 * MB) > h100.collective_s("all_gather", 256 * MB)


def test_json_round_trip_and_file_loading(tmp_path):
    hw = get_hardware("a100")
    path = tmp_path / "hw.json"
    path.write_text(hw.to_json())
    assert load_hardware(str(path)) == hw


def test_bad_hardware_files_and_names(tmp_path):
    with pytest.raises(UnknownNameError, match="h100"):
        get_hardware("tpu")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "peak_flops": 1, "memory_gib": 1, "warp_speed": 9}))
    with pytest.raises(ValueError, match="warp_speed"):
        load_hardware(str(bad))
    with pytest.raises(FileNotFoundError):
        load_hardware(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="mfu_gemm"):
        HardwareSpec(name="x", peak_flops=1, memory_gib=1, mfu_gemm=1.5)
