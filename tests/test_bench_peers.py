"""Peers: a missing library gives a row with no figure and a note saying what installs it; the others
still run; each peer is run at its best measured count."""
import sys

import pytest
from helpers import fake_clock, tiny_convnet

from torchspeed.bench import peers


@pytest.fixture
def no_peer_libraries(monkeypatch):
    for name in ("nvidia", "nvidia.dali", "litdata", "openvino", "onnxruntime"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError


def test_missing_peer_library_names_the_extra(no_peer_libraries):
    with pytest.raises(peers.PeerMissing, match=r"dali not installed\W.*torchspeed\[peers\]"):
        peers.DaliLoader("/nowhere", 64, 128, 2, (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(peers.PeerMissing, match=r"litdata not installed"):
        peers.litdata_loader("/nowhere", 64, 128, 0, (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(peers.PeerMissing, match=r"openvino not installed\W.*torchspeed\[openvino\]"):
        peers.openvino_latency("/nowhere/model.onnx")
    with pytest.raises(peers.PeerMissing, match=r"onnxruntime not installed"):
        peers.onnxruntime_defaults("/nowhere/model.onnx")


def test_data_peers_are_skipped_rows_with_the_note(no_peer_libraries, tmp_path):
    from torchspeed.bench.suites import data

    added, skipped = [], []
    data._peers(str(tmp_path), 2, 0.1, lambda s: None, lambda *a, **k: added.append(a), skipped.append)
    assert added == []
    assert [r.technique for r in skipped] == ["dali_cpu", "litdata"]
    for r in skipped:
        assert r.median is None and r.what.startswith("skipped: ") and "not installed" in r.what
        assert "pip install" in r.what and r.peer and r.unit == "img/s" and r.ceiling == "decode"


def test_a_peer_failing_with_an_empty_message_costs_only_its_row(monkeypatch, tmp_path):
    """StopIteration (a loader that yielded no batch) carries no message: the row names the exception."""
    from torchspeed.bench.suites import data

    def no_batch(*args, **kwargs):
        raise StopIteration

    def bare_error(*args, **kwargs):
        raise ValueError("")

    monkeypatch.setattr(peers, "DaliLoader", no_batch)
    monkeypatch.setattr(peers, "litdata_dir", bare_error)
    added, skipped = [], []
    data._peers(str(tmp_path), 2, 0.1, lambda s: None, lambda *a, **k: added.append(a), skipped.append)
    assert added == [] and [r.technique for r in skipped] == ["dali_cpu", "litdata"]
    assert skipped[0].what.endswith("failed here: StopIteration") and skipped[1].what.endswith("failed here: ValueError")


class _EpochsOfTwo:
    """A DALI-like iterator whose epoch end is reported by the next call after its last batch."""

    def __init__(self):
        self.calls = 0

    def __next__(self):
        self.calls += 1
        if self.calls % 3 == 0:
            raise StopIteration
        return [{"x": self.calls, "y": __import__("torch").tensor([1])}]


def test_dali_loader_starts_a_fresh_epoch_when_the_last_pass_left_one_ending():
    loader = peers.DaliLoader.__new__(peers.DaliLoader)
    loader.it = _EpochsOfTwo()
    assert [x for x, _ in loader] == [1, 2]
    assert [x for x, _ in loader] == [4, 5]  # each pass is one whole epoch
    loader.it.calls = 2  # a pass stopped after the epoch's last batch: its end is still pending
    assert next(iter(loader))[0] == 4


def test_peer_runs_at_its_best_count(monkeypatch):
    from torchspeed import measure
    from torchspeed.bench.suites import data

    clock = fake_clock(monkeypatch, measure)  # a batch takes exactly its fake's time, on a busy machine too

    class Loader:
        def __init__(self, n):
            self.n, self.closed = n, False

        def __iter__(self):
            for _ in range(50):
                clock.sleep(0.004 / self.n if self.n != 2 else 0.0005)  # 2 is the fastest count
                yield [0] * 8, [0] * 8

    best, loader, rates = data._best("fake", Loader, [1, 2, 3], 0.05, lambda s: None)
    assert best == 2 and loader.n == 2 and set(rates) == {1, 2, 3} and max(rates, key=rates.get) == 2


def test_infer_hand_set_runtimes_timed_against_the_chosen_variant(monkeypatch):
    """OpenVINO (LATENCY hint) and ONNX Runtime defaults run the same exported model, interleaved with the chosen
    variant at each batch size; a runtime that is not installed is a skipped row saying so."""
    import types

    import torch

    from torchspeed.bench.suites import infer

    pytest.importorskip("onnxruntime")
    model = tiny_convnet(classes=10).eval()

    def chosen(x):
        with torch.inference_mode():
            return model(x)

    best = types.SimpleNamespace(name="eager fp32", runner=chosen)
    res = types.SimpleNamespace(fastest_at=lambda b: best)
    monkeypatch.setitem(sys.modules, "openvino", None)
    rows, comparisons = infer._hand_set_peers("tiny", model, res, 16, 1e6, 2, lambda s: None)
    ov = [r for r in rows if "OpenVINO" in r.technique]
    assert len(ov) == 2 and all(r.median is None and "openvino not installed" in r.what for r in ov)
    ort = [r for r in rows if "ONNX Runtime defaults" in r.technique]
    assert [r.batch for r in ort] == [1, 8] and all(r.median > 0 and r.peer and r.unit == "ms" for r in ort)
    assert all(r.ceiling == "fp32" and r.flops_per_item == 1e6 for r in ort)
    assert [c["batch"] for c in comparisons] == [1, 8]
    for c in comparisons:
        assert c["fastest_hand"] == "ONNX Runtime defaults" and c["chosen"] == "eager fp32"
        assert c["chosen_vs_fastest_hand"] == pytest.approx(c["chosen_ms"] / c["hand_ms"]["ONNX Runtime defaults"])


def test_litdata_chatter_is_kept_aside_and_shown_only_on_failure(capfd):
    import os
    import subprocess
    import sys

    from torchspeed.bench.peers import _output_kept_aside

    with _output_kept_aside():  # a worker process writing to the inherited descriptors, as litdata's do
        subprocess.run([sys.executable, "-c", "import sys; print('advert'); print('progress', file=sys.stderr)"],
                       check=True)
    out, err = capfd.readouterr()
    assert "advert" not in out + err and "progress" not in out + err
    with pytest.raises(RuntimeError):
        with _output_kept_aside():
            os.write(1, b"why it failed\n")
            raise RuntimeError("optimize failed")
    out, err = capfd.readouterr()
    assert "why it failed" in err
    print("after")  # the descriptors are back
    assert capfd.readouterr().out == "after\n"
