"""The data benchmark suite end to end (slow: it packs and times real loaders)."""
import pytest


@pytest.mark.slow
def test_data_suite_quick_reports_the_issue_keys():
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
