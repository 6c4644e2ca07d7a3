"""Outputs that are not regular files, empty paths, OCCULT_DEBUG (issue 35, rows 1, 4 and 8).

An atomic write never replaces what is not a regular file: a symlink is followed (its target
replaced, the link kept); a device, a FIFO and stdout (`-`, /dev/stdout, a link to
/proc/self/fd/1) are written in place. Checked through `python -m occult` (through `cli.main`, the function
it calls, where stdout is not involved), with what each path is afterwards.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest
from _cli_helpers import TRACE, occult, one_clean_line, run_main

from occult import cli
from occult._atomic import check_writable, names_stdout, write_text_atomic

PLACE = ("place", "--trace", TRACE, "--devices", 4, "--method", "greedy", "-q")


def is_placement(text: str) -> bool:
    doc = json.loads(text)
    return doc["num_devices"] == 4 and len(doc["layers"]) == 4


# ------------------------------------------------------------------ the writer itself
def test_writer_follows_symlinks_and_writes_special_files_in_place(tmp_path):
    target = tmp_path / "target.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target.name)
    write_text_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to("made.json")
    write_text_atomic(dangling, "made")
    assert dangling.is_symlink() and (tmp_path / "made.json").read_text() == "made"
    write_text_atomic("/dev/null", "gone")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert names_stdout("-") and names_stdout("/dev/stdout") and not names_stdout(target)
    with pytest.raises(FileNotFoundError) as exc:
        check_writable("")
    assert "is empty" in exc.value.strerror
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.json", "link.json", "made.json", "target.json"]


# ------------------------------------------------------------------ --out through the real entry point
def test_out_symlink_keeps_the_link_and_replaces_its_target(tmp_path, capsys):
    target = tmp_path / "target.json"
    target.write_text("{}\n")
    target.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    code, _, err = run_main(capsys, *PLACE, "--out", link)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert is_placement(target.read_text()) and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "target.json"]


@pytest.mark.parametrize("out", ["-", "/dev/stdout", "fd-link"])
def test_out_stdout_prints_only_the_file(tmp_path, out):
    if out == "fd-link":
        out = tmp_path / "link.json"
        out.symlink_to("/proc/self/fd/1")
    proc = occult(*PLACE, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert is_placement(proc.stdout)  # the placement alone on stdout
    assert "E[C_T]" in proc.stderr and f"wrote {out}" in proc.stderr  # the report on stderr
    if out != "-":
        assert Path(out).is_symlink()
    assert list(tmp_path.iterdir()) == ([] if isinstance(out, str) else [out])


def test_out_dev_null_discards_and_dev_full_is_a_clear_error(capsys):
    # through cli.main in this process (what `python -m occult` calls): no stdout involved here
    code, out, err = run_main(capsys, *PLACE, "--out", "/dev/null")
    assert code == 0 and "wrote /dev/null" in out, err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    code, _, err = run_main(capsys, *PLACE, "--out", "/dev/full")
    one_clean_line(code, err, "/dev/full", "No space left on device")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_out_device_node_is_written_in_place(tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("mknod of a device needs root")
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers
    except PermissionError:
        pytest.skip("no CAP_MKNOD here")
    code, _, err = run_main(capsys, *PLACE, "--out", node)
    assert code == 0, err
    assert stat.S_ISCHR(node.lstat().st_mode) and node.lstat().st_rdev == os.makedev(1, 3)
    assert list(tmp_path.iterdir()) == [node]


def test_out_fifo_is_written_to_its_reader(tmp_path, capsys):
    fifo = tmp_path / "placement.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()  # opening a FIFO to write waits for a reader
    code, _, err = run_main(capsys, *PLACE, "--out", fifo)
    reader.join(timeout=60)
    assert code == 0, err
    assert got and is_placement(got[0].decode())
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and list(tmp_path.iterdir()) == [fifo]


def test_stdout_for_one_file_only(tmp_path, capsys):
    proc = occult(*PLACE, "--out", "-", "--plot", "/dev/stdout")
    one_clean_line(proc.returncode, proc.stderr, "--out and --plot name stdout")
    assert proc.stdout == ""
    code = cli.main(["data", "prepare", "--out", "-"])
    one_clean_line(code, capsys.readouterr().err, "--out - names stdout", "writes a directory")
    code = cli.main(["profile", "--model", str(TRACE), "--out", "-"])
    one_clean_line(code, capsys.readouterr().err, "--out - writes the trace to stdout", "--similarity")


# ------------------------------------------------------------------ empty paths (row 8)
def string_options(command: str) -> list[str]:
    """Every option of `command` that takes a string (a path, a name)."""
    parser = cli.build_parser(chosen=command)
    found = []
    for sub in _subparsers(parser, command):
        found += [
            max(a.option_strings, key=len)
            for a in sub._actions
            if a.option_strings
            and a.type is None
            and a.choices is None
            and a.nargs is None
            and not a.const
            and a.__class__.__name__ == "_StoreAction"
        ]
    return found


def _subparsers(parser, command: str):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                if name == command or command is None:
                    yield sub
                    yield from _subparsers(sub, None)


REQUIRED = {
    "place": ["--trace", str(TRACE), "-d", "4"],
    "stats": ["--trace", str(TRACE), "-d", "4"],
    "data": ["prepare", "--out", "x"],
    "train": ["--out", "x"],
    "finetune": ["--init", "x", "--out", "y"],
    "profile": ["--model", "m", "--out", "t"],
    "bench": [],
    "demo": [],
}


@pytest.mark.parametrize("command", [c.name for c in cli.COMMANDS])
def test_an_empty_value_names_its_flag(command, capsys):
    for flag in string_options(command):
        argv = [command, *REQUIRED[command]]
        if flag in argv:
            argv[argv.index(flag) + 1] = ""
        else:
            argv += [flag, ""]
        code = cli.main(argv)
        one_clean_line(code, capsys.readouterr().err, f"{flag} is empty")


def test_empty_out_through_the_entry_point():
    proc = occult(*PLACE, "--out", "")
    one_clean_line(proc.returncode, proc.stderr, "--out is empty")
    assert "directory" not in proc.stderr


# ------------------------------------------------------------------ OCCULT_DEBUG keeps the exit status (row 4)
def test_debug_adds_the_traceback_not_another_exit_status(capsys, monkeypatch):
    # through cli.main in this process (what `python -m occult` calls), which reads OCCULT_DEBUG at each call
    code, _, plain = run_main(capsys, "place", "--trace", "/etc/passwd", "--devices", 4)
    one_clean_line(code, plain, "/etc/passwd")
    monkeypatch.setenv("OCCULT_DEBUG", "1")
    code, _, debug = run_main(capsys, "place", "--trace", "/etc/passwd", "--devices", 4)
    assert code == 2, debug
    assert "Traceback (most recent call last)" in debug
    assert debug.strip().splitlines()[-1] == plain.strip()
