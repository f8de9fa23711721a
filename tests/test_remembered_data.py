"""fast_loader / tune_loader remember what they measured: recalled on the next call (nothing timed),
measured again on refresh, on another key, on a damaged entry, when the remembered settings are no
longer candidates, and never kept from a busy machine; the quiet-machine wait and the CLI's lines."""
import glob
import json
import logging
import os

import pytest
import torch
from torch.utils.data import Dataset

import torchspeed.measure as measure
from torchspeed.cli import main
from torchspeed.data import decoder_choice, fast_loader, loader, loader_tuning, tune, tune_loader
from torchspeed.runtime import cache_dir


class Squares(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.full((3, 4, 4), float(i)), i % 2


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    """A quiet machine for these tests (other tests load the cores): no wait, nothing called busy."""
    monkeypatch.setattr(tune, "QUIET_WAIT_S", 0.0)
    monkeypatch.setattr(measure, "busy_warning", lambda others_cores: None)
    monkeypatch.setattr(decoder_choice, "busy_warning", lambda others_cores: None)


@pytest.fixture
def timings(monkeypatch):
    """Counts the loader measurements and the decoder measurements that really ran."""
    calls = {"settings": 0, "decoders": 0}
    real_settings, real_decoders = loader.measure_settings, decoder_choice.measure_decoders

    def settings(*a, **k):
        calls["settings"] += 1
        return real_settings(*a, **k)

    def decoders(*a, **k):
        calls["decoders"] += 1
        return real_decoders(*a, **k)

    monkeypatch.setattr(loader, "measure_settings", settings)
    monkeypatch.setattr(loader_tuning, "measure_settings", settings)
    monkeypatch.setattr(decoder_choice, "measure_decoders", decoders)
    return calls


def _auto(data, batch_size=4, **kw):
    return fast_loader(data, batch_size, crop=16, device="cpu", num_workers=[0], threads=[1, 2], tune_seconds=0.02,
                       **kw)


def test_fast_loader_recalls_its_settings_and_decoder(photo_store, timings, caplog):
    caplog.set_level(logging.INFO, logger="torchspeed")
    first = _auto(photo_store)
    assert timings == {"settings": 1, "decoders": 1} and first.settings.remembered is None
    caplog.clear()
    said = []
    second = _auto(photo_store, progress=said.append)
    assert timings == {"settings": 1, "decoders": 1}  # nothing timed the second time
    assert second.settings.remembered.startswith("remembered from ")
    assert (second.threads, second.num_workers, second.decoder) == (first.threads, first.num_workers, first.decoder)
    assert second.settings.table == first.settings.table  # the measurement it came from
    lines = [r.getMessage() for r in caplog.records]
    assert f"fast_loader: {second.settings.remembered}" in lines
    assert any(line.startswith("decoder: remembered from ") and "us/image" in line for line in lines)
    assert any("remembered from" in s for s in said)
    images, labels = next(iter(second))
    assert images.shape == (4, 3, 16, 16) and labels.shape == (4,)


def test_refresh_another_key_or_a_damaged_entry_measures_again(photo_store, timings):
    _auto(photo_store)
    _auto(photo_store, refresh=True)
    assert timings == {"settings": 2, "decoders": 2}
    _auto(photo_store, batch_size=6)  # another batch size: another decision (same data: the decoder is recalled)
    assert timings == {"settings": 3, "decoders": 2}
    for path in glob.glob(os.path.join(cache_dir("decisions"), "*", "*.json")):
        with open(path, "w") as f:
            f.write("{not json")
    again = _auto(photo_store)
    assert timings == {"settings": 4, "decoders": 3} and again.settings.remembered is None
    assert _auto(photo_store).settings.remembered  # and the damaged entry was replaced by a good one


@pytest.mark.parametrize("damage", [[], None, {"decision": []}, {"decision": None}, {"decision": {"decoder": [1]}},
                                    {"decision": {"decoder": 7}}, {"decision": {"decoder": {"a": 1}, "table": []}},
                                    {"table": None}, {"table": [1, 2]}, {"table": "fast"}, "deeply nested"])
def test_a_damaged_decoder_decision_is_measured_again(photo_store, timings, damage):
    """`[]`, `null`, wrong types or deep nesting in the remembered decoder choice: measured again, never raised."""
    _auto(photo_store)
    (path,) = glob.glob(os.path.join(cache_dir("decisions", "decoder"), "*.json"))
    entry = json.load(open(path))
    if damage == "deeply nested":
        entry = "[" * 100_000 + "]" * 100_000
    elif isinstance(damage, dict) and "table" in damage:
        entry["decision"].update(damage)
    elif isinstance(damage, dict):
        entry.update(damage)
    else:
        entry = damage
    with open(path, "w") as f:
        f.write(entry if isinstance(entry, str) else json.dumps(entry))
    again = _auto(photo_store)
    assert timings["decoders"] == 2 and again.decoder_table  # measured again, not raised
    images, _ = next(iter(again))
    assert images.shape == (4, 3, 16, 16)
    _auto(photo_store)
    assert timings["decoders"] == 2  # and remembered again


def test_changed_files_are_other_data(photo_folder, tmp_path, timings):
    import shutil

    folder = shutil.copytree(photo_folder, tmp_path / "photos")
    _auto(str(folder))
    os.remove(next(glob.iglob(os.path.join(folder, "*", "*.jpg"))))
    _auto(str(folder))
    assert timings["settings"] == 2


def test_settings_no_longer_among_the_candidates_are_measured_again(photo_store, timings, monkeypatch):
    _auto(photo_store)
    (path,) = glob.glob(os.path.join(cache_dir("decisions", "loader"), "*.json"))
    entry = json.load(open(path))
    entry["decision"]["threads"] = 7  # say, a count only a bigger machine offered
    json.dump(entry, open(path, "w"))
    assert _auto(photo_store).settings.remembered is None and timings["settings"] == 2
    for module in (tune, loader):  # fewer cores: another machine as far as the decision goes
        monkeypatch.setattr(module, "usable_cores", lambda: 1)
    fast_loader(photo_store, 4, crop=16, device="cpu", num_workers=[0], threads="auto", tune_seconds=0.02)
    fast_loader(photo_store, 4, crop=16, device="cpu", num_workers=[0], threads="auto", tune_seconds=0.02)
    for module in (tune, loader):
        monkeypatch.setattr(module, "usable_cores", lambda: 2)
    fast_loader(photo_store, 4, crop=16, device="cpu", num_workers=[0], threads="auto", tune_seconds=0.02)
    assert timings["settings"] == 4  # measured at 1 core, recalled at 1 core, measured again at 2


def test_a_measurement_on_a_busy_machine_is_not_remembered(photo_store, timings, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="torchspeed")
    monkeypatch.setattr(measure, "busy_warning", lambda others_cores: "the machine was busy: a test says so")
    busy = _auto(photo_store)
    assert busy.settings.busy_warning and "not remembered" in caplog.text
    assert _auto(photo_store).settings.remembered is None and timings["settings"] == 2


def test_timing_waits_for_a_quiet_machine_first(monkeypatch):
    waits = []

    def wait(max_s, **kw):
        waits.append(max_s)
        return measure.Quiet(0.75, 0.0)

    monkeypatch.setattr(tune, "QUIET_WAIT_S", 2.0)
    monkeypatch.setattr(measure, "wait_for_quiet_machine", wait)
    result = tune_loader(Squares(), 8, num_workers=[0], tune_seconds=0.02, device="cpu", prefetch_factor=(2,),
                         persistent_workers=(True,))
    assert waits == [2.0] and result.waited_s == 0.75


def test_tune_loader_recalls_a_dataset_but_not_a_factory(timings):
    kw = dict(num_workers=[0], tune_seconds=0.02, device="cpu", prefetch_factor=(2,), persistent_workers=(True,))
    first = tune_loader(Squares(), 8, **kw)
    second = tune_loader(Squares(), 8, **kw)  # another instance of the same Dataset class and length
    assert timings["settings"] == 1
    assert first.remembered is None and second.remembered.startswith("remembered from ")
    assert second.to_dict()["remembered"] == second.remembered and "busy_warning" in second.to_dict()
    assert "remembered from" in str(second)
    assert tune_loader(Squares(), 8, refresh=True, **kw).remembered is None and timings["settings"] == 2

    def build(num_workers, prefetch_factor, persistent_workers, pin_memory):
        return [torch.zeros(8)] * 4

    tune_loader(build, 8, **kw)
    assert tune_loader(build, 8, **kw).remembered is None  # a factory has no identity to be remembered by


def test_cli_tune_loader_says_remembered_busy_and_refresh(photo_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    args = ["tune-loader", photo_folder, "--batch-size", "4", "--crop", "16", "--num-workers", "0",
            "--threads", "1,2", "--tune-seconds", "0.02"]
    assert main(args + ["--json", str(tmp_path / "a.json")]) == 0
    assert "remembered from" not in capsys.readouterr().out
    assert main(args + ["--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "remembered from" in out and "--refresh measures again" in out
    assert json.loads((tmp_path / "b.json").read_text())["remembered"].startswith("remembered from ")
    monkeypatch.setattr(measure, "busy_warning", lambda others_cores: "the machine was busy: a test says so")
    assert main(args + ["--refresh", "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "remembered from" not in out and "note: the machine was busy: a test says so" in out
    fresh = json.loads((tmp_path / "c.json").read_text())
    assert fresh["remembered"] is None and fresh["busy_warning"] == "the machine was busy: a test says so"
