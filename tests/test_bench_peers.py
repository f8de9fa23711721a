"""Peers: a missing library gives a row with no figure and a note saying what installs it; the others
still run; each peer is run at its best measured count."""
import sys

import pytest

from torchspeed.bench import peers


@pytest.fixture
def no_peer_libraries(monkeypatch):
    for name in ("nvidia", "nvidia.dali", "litdata", "openvino", "onnxruntime"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError


def test_missing_peer_library_names_the_extra(no_peer_libraries):
    with pytest.raises(peers.PeerMissing, match=r"dali not installed .*torchspeed\[peers\]"):
        peers.DaliLoader("/nowhere", 64, 128, 2, (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(peers.PeerMissing, match=r"litdata not installed"):
        peers.litdata_loader("/nowhere", 64, 128, 0, (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(peers.PeerMissing, match=r"openvino not installed .*torchspeed\[infer\]"):
        peers.openvino_latency("/nowhere/model.onnx")
    with pytest.raises(peers.PeerMissing, match=r"onnxruntime not installed"):
        peers.onnxruntime_defaults("/nowhere/model.onnx")


def test_data_peers_are_skipped_rows_with_the_note(no_peer_libraries, tmp_path):
    from torchspeed.bench.suites import data

    added, skipped = [], []
    data._peers(str(tmp_path), 2, 0.1, lambda s: None, lambda *a, **k: added.append(a), skipped.append)
    assert added == []
    assert [r["technique"] for r in skipped] == ["dali_cpu", "litdata"]
    for r in skipped:
        assert r["median"] is None and r["what"].startswith("skipped: ") and "not installed" in r["what"]
        assert "pip install" in r["what"] and r["peer"] and r["unit"] == "img/s"


def test_peer_runs_at_its_best_count():
    from torchspeed.bench.suites import data

    class Loader:
        def __init__(self, n):
            self.n, self.closed = n, False

        def __iter__(self):
            import time

            for _ in range(50):
                time.sleep(0.004 / self.n if self.n != 2 else 0.0005)  # 2 is the fastest count
                yield [0] * 8, [0] * 8

    best, loader, rates = data._best("fake", Loader, [1, 2, 3], 0.05, lambda s: None)
    assert best == 2 and loader.n == 2 and set(rates) == {1, 2, 3} and max(rates, key=rates.get) == 2
