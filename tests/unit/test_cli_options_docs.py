"""An option is one `Options` field: its flag, help, default and docs/cli.md row come from the field.
These tests fail when a field lacks its flag (or the reason it has none), when a flag does not set
its option on every command that takes it, or when docs/cli.md's option tables are out of date."""

import argparse
from dataclasses import fields, make_dataclass

import pytest
from tests.conftest import ROOT

from paramserver.base.config import Options
from paramserver.base.option_fields import FLAG_GROUPS, Flag, choices_of, flag_of, option
from paramserver.launch import cli
from paramserver.launch.cli import docs
from paramserver.launch.cli.option_flags import GROUPS, flagged_fields

CLI_MD = ROOT / "docs" / "cli.md"
FLAGGED = flagged_fields()
PARSER = cli.build_parser()  # one for every test: building one takes tens of milliseconds


def _command_parsers() -> dict[str, argparse.ArgumentParser]:
    return cli.command_parsers(PARSER)


def _value(field) -> tuple[list[str], object]:
    """Words that give the field's flag a value other than its default, and the value they give."""
    if field.type == "bool":
        return [], not field.default
    if choices := choices_of(field):
        choice = next(c for c in choices if c != field.default)
        return [choice], choice
    if flag_of(field).byte_size:
        return ["3MiB"], 3 << 20
    return {"int": (["7"], 7), "float": (["2.5"], 2.5), "str": (["/some/where"], "/some/where")}[field.type]


def test_every_option_has_a_flag_or_says_why_it_has_none():
    for f in fields(Options):
        flag, why = f.metadata.get("flag"), f.metadata.get("no_flag")
        assert (flag is None) != (not why), f"Options.{f.name}: declare it with option(default, Flag(...)) or no_flag="


def test_every_option_without_a_flag_is_taken_by_no_command():
    unflagged = {f.name for f in fields(Options) if flag_of(f) is None}
    assert unflagged and not unflagged & {f.name for f, _ in FLAGGED}
    for command in _command_parsers().values():
        assert not unflagged & {action.dest for action in command._actions}


def test_every_flag_group_goes_to_commands_and_flag_names_are_unique():
    assert set(GROUPS) == set(FLAG_GROUPS)
    names = [flag.name for _, flag in FLAGGED]
    assert len(names) == len(set(names))
    commands = _command_parsers()
    assert all(set(group.commands) <= set(commands) for group in GROUPS.values())


@pytest.mark.parametrize("field, flag", FLAGGED, ids=[flag.name for _, flag in FLAGGED])
def test_each_flag_sets_its_option_on_every_command_that_takes_it(field, flag):
    words, value = _value(field)
    for command in GROUPS[flag.group].commands:
        positional = {"run": ["train.py"], "k8s": ["--image", "i", "train.py"]}.get(command, [])
        args = PARSER.parse_args([command, *positional[:-1], flag.name, *words, *positional[-1:]])
        given = cli.given_options(args)
        assert given == {field.name: value}, command
        assert type(given[field.name]) is type(value)
        assert cli.given_options(PARSER.parse_args([command, *positional])) == {}  # not given: left out


def test_a_command_outside_a_group_does_not_take_its_flags():
    commands = _command_parsers()
    for _, flag in FLAGGED:
        for name, command in commands.items():
            takes = any(flag.name in action.option_strings for action in command._actions)
            assert takes == (name in GROUPS[flag.group].commands), (flag.name, name)


def test_every_flags_help_shows_its_default_and_every_command_prints_its_help():
    for field, flag in FLAGGED:
        if "{default" in flag.help:
            assert "{" not in flag.help.format(default=field.default)
    for command in _command_parsers().values():
        assert "--help" in command.format_help()


def test_each_option_flag_has_its_row_in_docs_cli_md():
    text = CLI_MD.read_text(encoding="utf-8")
    for field, flag in FLAGGED:
        assert docs.row(field, flag) in text, f"{flag.name}: no row in docs/cli.md"
        assert f"| `{field.name}` |" in docs.row(field, flag)


def test_docs_cli_md_holds_the_option_tables_generated_from_the_options():
    text = CLI_MD.read_text(encoding="utf-8")
    assert docs.replaced(text, docs.markdown()) == text, (
        "docs/cli.md is out of date: run `python -m paramserver.launch.cli.docs --write docs/cli.md`"
    )


def test_the_docs_entry_point_checks_and_writes_the_tables(tmp_path, capsys):
    stale = tmp_path / "cli.md"
    stale.write_text(f"intro\n\n{docs.BEGIN}\n| `--old` |\n{docs.END}\n\nrest\n", encoding="utf-8")
    assert docs.main(["--check", str(stale)]) == 1
    assert "run with --write" in capsys.readouterr().err
    assert docs.main(["--write", str(stale)]) == 0
    assert docs.main(["--check", str(stale)]) == 0
    written = stale.read_text(encoding="utf-8")
    assert written.startswith("intro\n\n") and written.endswith("\n\nrest\n") and "`--old`" not in written
    unmarked = tmp_path / "plain.md"
    unmarked.write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no BEGIN/END markers"):
        docs.main(["--check", str(unmarked)])


def test_defaults_are_written_as_people_write_them():
    shown = {f.name: docs.shown(f) for f in fields(Options)}
    assert (shown["max_table_rows"], shown["max_table_memory_bytes"], shown["max_message_bytes"]) == (
        "2^27",
        "16 GiB",
        "1 GiB",
    )
    assert (shown["rpc_timeout_s"], shown["max_gradient_magnitude"], shown["resume"], shown["logdir"]) == (
        "60",
        "1e15",
        "off",
        "none",
    )


def test_a_declaration_without_flag_or_reason_or_with_a_bad_flag_is_refused():
    with pytest.raises(TypeError, match="a reason"):
        option(1)
    with pytest.raises(TypeError, match="a reason"):
        option(1, Flag("--x", "limits", "x"), no_flag="both")
    with pytest.raises(TypeError, match="must start with --"):
        Flag("x", "limits", "x")
    with pytest.raises(TypeError, match="group 'nowhere'"):
        Flag("--x", "nowhere", "x")


def test_a_flag_without_docs_words_has_its_help_as_its_row_less_the_default():
    declared = make_dataclass(
        "Declared", [("retries", "int", option(2, Flag("--retries", "limits", "retries (default {default})", "N")))]
    )
    (field,) = fields(declared)
    assert docs.row(field, flag_of(field)) == "| `--retries N` | `retries` | 2 | retries |"
