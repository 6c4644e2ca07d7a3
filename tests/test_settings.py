"""occult.settings: every environment variable parsed in one place, re-read when it changes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from occult import settings
from occult.settings import Settings, SettingsError


@pytest.fixture
def clean_env(monkeypatch):
    for name in settings.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch  # current() re-reads once monkeypatch restores the environment


def test_defaults_with_nothing_set(clean_env):
    assert settings.current() == Settings()
    assert Settings() == Settings(
        wgrad="auto",
        dgrad1="auto",
        gemm1="auto",
        scatter="deterministic",
        plan="auto",
        cache=None,
        debug=False,
        triton_interpret=False,
        nccl_p2p_disable=False,
        rank_start="spawn",
        agreement="call",
        commit=None,
        defer_wgrad=False,
        kernel_grid="persistent",
    )


def test_every_variable_sets_its_field(clean_env, tmp_path):
    values = {
        "OCCULT_WGRAD": "Triton",
        "OCCULT_DGRAD1": "grouped_mm",
        "OCCULT_GEMM1": "TRITON",
        "OCCULT_SCATTER": "atomic",
        "OCCULT_PLAN": "torch",
        "OCCULT_CACHE": str(tmp_path),
        "OCCULT_DEBUG": "1",
        "TRITON_INTERPRET": "yes",
        "NCCL_P2P_DISABLE": "1",
        "OCCULT_RANK_START": "forkserver",
        "OCCULT_AGREEMENT": "Call",
        "OCCULT_COMMIT": " abc1234-dirty ",
        "OCCULT_DEFER_WGRAD": "yes",
        "OCCULT_KERNEL_GRID": "Tiles",
    }
    assert set(values) == set(settings.VARIABLES)
    for name, value in values.items():
        clean_env.setenv(name, value)
    assert settings.current() == Settings(
        "triton",
        "grouped_mm",
        "triton",
        "atomic",
        "torch",
        tmp_path,
        True,
        True,
        True,
        "forkserver",
        "call",
        "abc1234-dirty",
        True,
        "tiles",
    )
    assert {f.name for f in dataclasses.fields(Settings)} == set(settings.VARIABLES.values())


def test_a_change_is_seen_at_the_next_call_and_nothing_is_parsed_otherwise(clean_env):
    first = settings.current()
    assert settings.current() is first  # cached while the environment is unchanged
    clean_env.setenv("OCCULT_SCATTER", "atomic")
    assert settings.current().scatter == "atomic"
    clean_env.setenv("TRITON_INTERPRET", "0")  # explicitly off equals unset
    assert settings.current().triton_interpret is False
    clean_env.delenv("OCCULT_SCATTER")
    assert settings.current() == first
    assert settings.reload() == first and settings.current() is not first  # reload: parsed anew


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("OCCULT_WGRAD", "cutlass", "auto, triton, grouped_mm"),
        ("OCCULT_DGRAD1", "fast", "auto, triton, grouped_mm"),
        ("OCCULT_GEMM1", "cublas", "auto, triton, grouped_mm"),
        ("OCCULT_SCATTER", "atomics", "deterministic, atomic"),
        ("OCCULT_PLAN", "numpy", "auto, torch, triton"),
        ("OCCULT_AGREEMENT", "layer", "call, step"),
        ("OCCULT_DEBUG", "maybe", "1 or 0"),
        ("OCCULT_DEFER_WGRAD", "sometimes", "1 or 0"),
        ("TRITON_INTERPRET", "2", "1 or 0"),
    ],
)
def test_a_bad_value_names_the_variable_and_what_is_allowed(clean_env, name, value, allowed):
    clean_env.setenv(name, value)
    with pytest.raises(SettingsError, match=re.escape(f"{name}={value!r}")) as err:
        settings.current()
    assert allowed in str(err.value) and "docs/settings.md" in str(err.value)
    clean_env.delenv(name)
    assert settings.current() == Settings()  # and it recovers once fixed


def test_docs_list_every_variable_with_its_default():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", doc, re.M)}
    assert set(settings.VARIABLES) <= set(rows), sorted(set(settings.VARIABLES) - set(rows))
    for name, field in settings.VARIABLES.items():
        default = getattr(Settings(), field)
        if isinstance(default, str):
            assert f"`{default}`" in rows[name], (name, rows[name])


def test_occult_debug_shows_the_traceback_and_a_bad_value_is_a_clear_cli_error(clean_env, tmp_path, capsys):
    from occult.cli import main

    argv = ["stats", "--trace", str(tmp_path / "missing.safetensors"), "--placement", str(tmp_path / "missing.json")]
    assert main(argv) == 2 and "occult: error:" in capsys.readouterr().err
    clean_env.setenv("OCCULT_DEBUG", "1")  # the traceback too, the same exit status
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "CommandError" in err and err.strip().splitlines()[-1].endswith("does not exist")
    clean_env.setenv("OCCULT_DEBUG", "maybe")
    assert main(argv) == 2 and "OCCULT_DEBUG='maybe'" in capsys.readouterr().err
