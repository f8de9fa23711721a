"""The data benchmark suite end to end (slow: it packs and times real loaders)."""
import pytest


@pytest.mark.slow
def test_data_suite_quick_reports_its_figures_rows_and_goals():
    from torchspeed.bench.suites import data

    result = data.run(quick=True, progress=lambda text: None)
    for key in ("baseline_img_s", "baseline_tuned_img_s", "torchspeed_img_s", "ratio_vs_tuned", "pack_s"):
        assert result[key] > 0, key
    assert result["ratio_vs_tuned"] == pytest.approx(result["torchspeed_img_s"] / result["baseline_tuned_img_s"])
    names = [r["technique"] for r in result["rows"]]
    assert names[:3] == ["baseline", "baseline_tuned", "torchspeed"]
    assert {"dali_cpu", "litdata"} <= set(names)  # measured, or a row saying why not
    timed = [r for r in result["rows"] if r["median"] is not None]
    assert all(r["unit"] == "img/s" and r["min"] <= r["median"] <= r["max"] for r in timed)
    assert all(r["ceiling"] == "decode" for r in result["rows"])
    assert all(r["what"].startswith("skipped: ") for r in result["rows"] if r["median"] is None)
    assert "scale" not in result  # the full report only
    assert [lim["goal"] for lim in result["limits"]][1].startswith(">= 2x DALI")


def test_the_suite_counts_its_worker_processes_when_it_waits_for_quiet():
    """The wait before each timed pass must see a DataLoader worker still busy: a child's CPU time counts."""
    import subprocess
    import sys
    import time

    from torchspeed.measure import process_tree_cpu_seconds, wait_until_quiet

    before = process_tree_cpu_seconds()
    if before is None:
        pytest.skip("no /proc here: the suite does not wait")
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\ntime.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while process_tree_cpu_seconds() - before < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_tree_cpu_seconds() - before >= 0.25  # the child's 0.3 s of CPU, seen from the parent
        assert wait_until_quiet(max_s=1.0) < 5  # a sleeping child is quiet, and the wait is bounded
    finally:
        child.kill()
        child.wait()


def test_data_goal_splits_an_image_into_decode_other_cpu_and_idle_core_time():
    from torchspeed.bench.suites.data import _data_limits

    ceilings = {"items": {"decode_per_core": {"value": 8000.0, "route": "simplejpeg-fast"}}}
    # 2 cores at 4,000 img/s = 500 core-us per image; decode 125 us; the loader used 300 CPU-us per image
    lim = _data_limits(4000.0, {"dali_cpu": 1900.0}, 2, ceilings, threads=2, workers=0, cpu_us=300.0)[0]
    assert lim["met"] is False and "25% of 16,000" in lim["measured"]
    assert "500 core-us" in lim["why"] and "125 us (25%)" in lim["why"]
    assert "175 us went to reading" in lim["why"] and "200 us of core time per image no loader thread used" in lim["why"]
    assert "other processes" in _data_limits(4000.0, {}, 2, ceilings, 2, 0)[0]["why"]  # no CPU figure: decode and the rest


def test_time_breakdown_example_runs_on_a_small_store(tmp_path):
    """docs/examples/data_time_breakdown.py reads loader internals: it must keep running as they change."""
    import subprocess
    import sys
    from pathlib import Path

    from torchspeed.data import make_photo_folder, pack

    folder = make_photo_folder(str(tmp_path / "photos"), n_images=40, size=(120, 90))
    pack(folder, str(tmp_path / "store"), short_side=64, format="jpeg", quality=90, progress=False)
    script = Path(__file__).resolve().parents[1] / "docs" / "examples" / "data_time_breakdown.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "store"), "--crop", "32", "--batch", "8",
                          "--images", "32"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "decode" in out.stdout
