"""Output folders: new or torchspeed's own; a user's file is never replaced, with or without overwrite."""
from __future__ import annotations

import os

import pytest

from torchspeed.outputs import MARKER, claim_output_dir


def test_a_new_folder_is_created_marked_and_records_what_was_written(tmp_path):
    out = claim_output_dir(tmp_path / "new", "optimize")
    assert os.path.isfile(tmp_path / "new" / MARKER)
    (tmp_path / "new" / "model.onnx").write_bytes(b"x")
    out.record("model.onnx")
    assert out.written() == ["model.onnx"]
    again = claim_output_dir(tmp_path / "new", "optimize", overwrite=True, replaces=("model.onnx",))
    assert again.written() == ["model.onnx"]


def test_a_users_own_file_refuses_the_folder_even_with_overwrite(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"the user's weights")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="'model.pt'.*never replaced"):
            claim_output_dir(tmp_path, "train", overwrite=overwrite)
    assert (tmp_path / "model.pt").read_bytes() == b"the user's weights"


def test_an_earlier_output_is_replaced_only_with_overwrite(tmp_path):
    out = claim_output_dir(tmp_path, "prune")
    (tmp_path / "model.pt").write_bytes(b"pruned")
    out.record("model.pt")
    with pytest.raises(ValueError, match="already holds 'model.pt'.*--overwrite"):
        claim_output_dir(tmp_path, "prune", replaces=("model.pt",))
    claim_output_dir(tmp_path, "prune", overwrite=True, replaces=("model.pt",))


def test_a_file_path_and_an_unwritable_folder_fail_before_any_work(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        claim_output_dir(tmp_path / "f", "optimize")
    with pytest.raises(OSError, match="cannot be written"):
        claim_output_dir(tmp_path / "f" / "sub", "optimize")  # a folder inside a file cannot be made


def test_a_temporary_left_by_an_interrupted_save_does_not_refuse_the_folder(tmp_path):
    claim_output_dir(tmp_path, "optimize")
    (tmp_path / ".model.onnx.abc123.tmp").write_bytes(b"half")
    (tmp_path / ".torchspeed-save.partial-999999-x").mkdir()
    claim_output_dir(tmp_path, "optimize")
    (tmp_path / ".hidden-user-file").write_text("mine")
    with pytest.raises(ValueError, match="hidden-user-file"):
        claim_output_dir(tmp_path, "optimize")
