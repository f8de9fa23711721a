"""The one table style at 80 columns (a pipe, CI, a default terminal): a grid where it fits, else a block per
row, every cell whole either way; doctor's and lint's tables printed through it."""
import io

from rich.console import Console

from torchspeed.doctor.output import print_lint, print_profile
from torchspeed.tables import grid_fits, print_table


def _console(width=80):
    return Console(width=width, record=True, file=io.StringIO(), color_system=None)


def _lines(con):
    lines = con.export_text().splitlines()
    assert max(len(line) for line in lines) <= con.width, [line for line in lines if len(line) > con.width]
    return lines


COLUMNS = ["technique", "median", "unit", "ratio", "cumulative", "metric drop", "achieved of ceiling"]
ROWS = [("baseline_torchvision_loader", 345.0, "img/s", 1.0, 1.0, None, "decode: 345 of 15,976 img/s (2%)"),
        ("+ channels_last memory format", 41.2, "samples/s", 1.2, 1.44, 0.002, "fp32: 90 of 161 GFLOP/s (56%)")]


def test_a_wide_table_at_80_columns_prints_each_row_whole():
    con = _console(80)
    print_table("train: samples/s", COLUMNS, ROWS, con)
    lines = _lines(con)
    assert not any("│" in line or "┃" in line for line in lines)  # no squeezed grid
    assert "baseline_torchvision_loader" in lines and "+ channels_last memory format" in lines
    text = " ".join(line.strip() for line in lines)
    for cell in ("decode: 345 of 15,976 img/s (2%)", "fp32: 90 of 161 GFLOP/s (56%)", "cumulative 1.44",
                 "metric drop 0.002", "unit samples/s"):
        assert cell in text, cell
    assert "metric drop" not in lines[lines.index("baseline_torchvision_loader") + 1]  # an empty cell is left out

    wide = _console(200)
    print_table("train: samples/s", COLUMNS, ROWS, wide)
    assert any("┃ technique" in line for line in _lines(wide))  # the same table as a grid where it fits


def test_a_table_with_one_long_column_stays_a_grid_and_wraps_only_that_column():
    rows = [("default precision", "bf16: the CPU has native bf16 dot products (AVX512-BF16), measured faster than "
                                  "fp32 on a GEMM of the model's size"), ("cores", "2"), ("cache", "/a-long-path" * 9)]
    con = _console(80)
    print_table("This machine", ["what", "value"], rows, con)
    lines = _lines(con)
    assert any("│ default precision" in line for line in lines) and any("│ cores" in line for line in lines)
    assert not any("\u2026" in line for line in lines)  # a word longer than its column is folded, not cut
    assert grid_fits(["a", "b"], [["x" * 20, "y" * 200]], 80) and not grid_fits(COLUMNS, [list(map(str, ROWS[0]))], 80)


def test_doctors_tables_read_at_80_columns():
    layers = [{"layer": f"features.{i}.block.{i}.conv_pw", "type": "Conv2d", "ops": ["aten::convolution"],
               "flops": 1.2e8 * (i + 1), "memory_bytes": 2.0e6, "time_s": 0.002 * (i + 1), "time_share": 0.1}
              for i in range(3)]
    lint = {"model": "mobilenet_v3_small", "input_shape": [1, 3, 224, 224],
            "totals": {"flops": 1.2e9, "memory_bytes": 3.0e7, "params": 2.5e6, "time_s": 0.02, "ops": 140},
            "layers": layers, "by_kind": {"conv": {"ops": 52, "flops": 1.1e9, "memory_bytes": 2e7, "time_s": 0.015,
                                                   "time_share": 0.75}},
            "findings": []}
    con = _console(80)
    print_lint(lint, con)
    text = " ".join(line.strip() for line in _lines(con))
    for layer in layers:
        assert layer["layer"] in text
    assert "Top 12 layers by measured time" in text and "No findings" in text

    profile = {"wall_s": 2.0, "steps": 10, "phases": {"data": 0.5, "forward": 0.6, "backward": 0.8, "optimizer": 0.1},
               "verdict": "compute-bound", "evidence": ["forward + backward are 70% of the step"],
               "hotspots": [{"function": "torch/nn/modules/module.py:1736(_call_impl)", "calls": 1200,
                             "cumulative_s": 1.3, "self_s": 0.02}], "findings": []}
    con = _console(80)
    print_profile(profile, con)
    lines = _lines(con)
    assert any("│ backward" in line for line in lines)  # three short columns: a grid
    assert "torch/nn/modules/module.py:1736(_call_impl)" in " ".join(line.strip() for line in lines)
    assert not any("\u2026" in line for line in lines)  # no cell cut short
