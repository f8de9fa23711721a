"""The `torchspeed` command's shared behaviour: help without torch, usage errors as one line, log lines on
stderr only, `--json -`, `info`, and help text for every option."""
import os
import subprocess
import sys

import pytest

from torchspeed.cli import main

EXE = [sys.executable, "-m", "torchspeed"]


def test_help_and_version_do_not_import_torch():
    code = ("import sys; from torchspeed.cli import build_parser; build_parser(); "
            "assert 'torch' not in sys.modules, 'torch imported'; print('clean')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    v = subprocess.run(EXE + ["--version"], capture_output=True, text=True, timeout=60)
    assert v.returncode == 0 and v.stdout.startswith("torchspeed ")


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("demo-data", "bench", "info"):
        assert cmd in out


def test_unknown_subcommand_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_demo_data_negative_image_count_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo-data", "x", "--images", "-3"])
    assert e.value.code == 2
    assert "positive integer" in capsys.readouterr().err


def test_demo_data_unwritable_dir_is_one_line_no_traceback(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = main(["demo-data", str(blocker / "sub"), "--images", "2", "--classes", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot create the demo folder" in err and "Traceback" not in err


def test_demo_data_writes_images(tmp_path):
    assert main(["demo-data", str(tmp_path / "d"), "--images", "4", "--classes", "2", "--seed", "3"]) == 0
    assert len(os.listdir(tmp_path / "d" / "class_00")) == 2


def test_info_writes_json(tmp_path):
    import json

    assert main(["info", "--json", str(tmp_path / "m.json")]) == 0
    info = json.loads((tmp_path / "m.json").read_text())
    assert info["cores"] >= 1 and "default_precision" in info


def _emit_info(args):
    import logging

    logging.getLogger("torchspeed.data.tune").info("chose threads=2 (5,000 img/s)")
    return 0


@pytest.mark.parametrize("flags, shown", [([], True), (["--quiet"], False), (["-v"], True)])
def test_measured_choices_are_logged_to_stderr_only(flags, shown, capsys, monkeypatch):
    """The CLI shows torchspeed's INFO lines on stderr (stdout stays clean), and restores the logger after."""
    import logging

    from torchspeed import cli

    parser = cli.build_parser()
    real_parse = parser.parse_args

    def parse(argv):
        args = real_parse(argv)
        args.func = _emit_info  # `info`'s options, a stand-in command that logs one measured choice
        return args

    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(parser, "parse_args", parse)
    ours = logging.getLogger("torchspeed")
    root_before = (logging.getLogger().level, list(logging.getLogger().handlers))
    ours_before = (ours.level, list(ours.handlers))
    assert cli.main([*flags, "info"]) == 0
    out, err = capsys.readouterr()
    assert ("chose threads=2" in err) == shown and "chose threads=2" not in out
    assert (ours.level, list(ours.handlers)) == ours_before and ours.level == logging.NOTSET
    assert (logging.getLogger().level, list(logging.getLogger().handlers)) == root_before


def test_json_dash_prints_json_alone_on_stdout(capsys, tmp_path):
    """`--json -`: stdout is exactly the JSON (pipe it to jq); the table goes to stderr; no file named '-'."""
    import json

    assert main(["info", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["cores"] >= 1
    assert "This machine" in err and "This machine" not in out
    assert not os.path.exists("-")


def test_info_lists_libraries_decoders_and_runtimes_with_no_blank_cells(capsys, monkeypatch):
    """Every optional library with its version or 'not installed'; the usable JPEG decoders and inference
    runtimes; CUDA 'none' when there is none."""
    import json

    from torchspeed.cli import info

    monkeypatch.setattr(info, "LIBRARIES", info.LIBRARIES + (("not-a-lib", ("torchspeed-no-such-dist",)),))
    assert main(["info", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert d["libraries"]["rich"] and d["libraries"]["not-a-lib"] is None
    assert "not installed" in err
    assert "simplejpeg" in d["decoders"] and "pil" in d["decoders"]
    assert d["runtimes"]["torch"] is None  # torch always runs
    if d["cuda"] is None:
        assert "│ cuda " in err and "none" in err.split("│ cuda ")[1].split("\n")[0]


def test_every_option_has_help_and_a_named_metavar():
    """Placeholders say what goes there (N, PATH, DIR, S...), never argparse's upper-cased dest."""
    import argparse

    from torchspeed.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    problems = []
    for name, p in sub.choices.items():
        for action in p._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            flag = action.option_strings[-1]
            if not action.help:
                problems.append(f"{name} {flag}: no help")
            takes_value = action.nargs != 0 and not isinstance(action, argparse.BooleanOptionalAction)
            if takes_value and action.metavar is None and action.choices is None:
                problems.append(f"{name} {flag}: metavar {action.dest.upper()}")
    assert not problems, "\n".join(problems)
