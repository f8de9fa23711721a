"""`torchspeed pack` and `torchspeed tune-loader`."""
import json
import os

from torchspeed.cli import main
import pytest

from torchspeed.data import PackedDataset, make_photo_folder


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # rich would wrap long paths mid-word at 80 columns


def test_pack_command_writes_a_store_and_json(tmp_path, capsys):
    src = make_photo_folder(tmp_path / "photos", 8, n_classes=2, seed=0, size=(80, 60), num_workers=1)
    open(os.path.join(src, "class_01", "junk.txt"), "w").write("not an image")
    code = main(["pack", src, str(tmp_path / "s"), "--short-side", "30", "--format", "raw", "--on-error", "skip",
                 "--num-workers", "1", "--json", str(tmp_path / "r.json")])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert code == 0 and "packed 8 samples" in out and "junk.txt" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["written"] == 8 and report["skipped"][0]["path"].endswith("junk.txt")
    ds = PackedDataset(tmp_path / "s")
    assert len(ds) == 8 and min(ds[0][0].shape[:2]) == 30 and ds.encoding == "raw"


def test_pack_command_errors_are_one_line(tmp_path, capsys):
    assert main(["pack", str(tmp_path / "nope"), str(tmp_path / "s")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "does not exist" in err and "Traceback" not in err
    src = make_photo_folder(tmp_path / "photos", 4, n_classes=2, seed=0, size=(40, 30), num_workers=1)
    open(os.path.join(src, "class_00", "bad.jpg"), "wb").write(b"\xff\xd8garbage")
    assert main(["pack", src, str(tmp_path / "s"), "--num-workers", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "bad.jpg" in err and "--on-error skip" in err
    assert not (tmp_path / "s").exists()


def test_tune_loader_command(photo_folder, tmp_path, capsys):
    code = main(["tune-loader", photo_folder, "--batch-size", "4", "--crop", "32", "--num-workers", "0,1",
                 "--threads", "1", "--tune-seconds", "0.1", "--json", str(tmp_path / "t.json")])
    assert code == 0
    assert "best: fast_loader(..., num_workers=" in capsys.readouterr().out
    settings = json.loads((tmp_path / "t.json").read_text())
    assert settings["num_workers"] in (0, 1) and [r["num_workers"] for r in settings["table"]][:1] == [0]
    tried = {(r["num_workers"], r["threads"]) for r in settings["table"]}
    assert {(0, 1), (1, 1)} <= tried  # threads in this process and a worker process both measured
    assert settings["threads"] >= 1


@pytest.mark.parametrize("command", ["demo-data", "pack", "tune-loader", "train"])
def test_every_option_has_help(command):
    import argparse

    from torchspeed.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [a.option_strings or a.dest for a in sub.choices[command]._actions if not a.help]
    assert not missing, f"{command}: options without help: {missing}"


def test_count_options_take_auto_a_number_or_a_list(capsys):
    from torchspeed.cli.data import counts

    assert counts(0)("auto") == "auto" and counts(0)("3") == 3 and counts(0)("2,0,2") == [0, 2]
    with pytest.raises(SystemExit):
        main(["tune-loader", "x", "--threads", "0"])  # threads start at 1
    assert "expected auto, a number >= 1" in capsys.readouterr().err
