"""An option is one `Options` field: its flag, help, default, meaning and its rows of docs/cli.md and
docs/configuration.md come from the field. These tests fail when a field lacks its flag (or the
reason it has none) or its meaning, when a flag does not set its option on every command that takes
it, when the docs' option tables are out of date, or when a link in them leads nowhere."""

import argparse
import dataclasses
import re
from dataclasses import fields, make_dataclass

import pytest
from tests.conftest import ROOT

from paramserver.base.config import Options
from paramserver.base.options.fields import FLAG_GROUPS, Flag, choices_of, flag_of, meaning_of, option, range_of
from paramserver.launch import cli
from paramserver.launch.cli import docs
from paramserver.launch.cli.option_flags import GROUPS, flagged_fields

CLI_MD = ROOT / "docs" / "cli.md"
CONFIGURATION_MD = ROOT / "docs" / "configuration.md"
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
        positional = {"run": ["train.py"], "k8s": ["--image", "i", "train.py"], "slurm": ["train.py"]}.get(command, [])
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
    assert docs.FLAGS.replaced(text) == text, (
        "docs/cli.md is out of date: run `python -m paramserver.launch.cli.docs --write docs/cli.md`"
    )


def test_each_option_has_its_row_in_docs_configuration_md():
    text = CONFIGURATION_MD.read_text(encoding="utf-8")
    for f in fields(Options):
        assert docs.key_row(f) in text, f"{f.name}: no row in docs/configuration.md"
    assert text.count(docs.KEYS.begin) == 1 and docs.FLAGS.begin not in text


def test_docs_configuration_md_holds_the_key_table_generated_from_the_options():
    text = CONFIGURATION_MD.read_text(encoding="utf-8")
    assert docs.KEYS.replaced(text) == text, (
        "docs/configuration.md is out of date: run "
        "`python -m paramserver.launch.cli.docs --write docs/configuration.md`"
    )


def test_the_docs_entry_point_checks_and_writes_the_tables(tmp_path, capsys):
    stale_cli, stale_keys = tmp_path / "cli.md", tmp_path / "configuration.md"
    stale_cli.write_text(f"intro\n\n{docs.FLAGS.begin}\n| `--old` |\n{docs.FLAGS.end}\n\nrest\n", encoding="utf-8")
    stale_keys.write_text(f"keys\n{docs.KEYS.begin}\n| `old` |\n{docs.KEYS.end}\nend\n", encoding="utf-8")
    for stale in (stale_cli, stale_keys):
        assert docs.main(["--check", str(stale)]) == 1
        assert f"run `python -m paramserver.launch.cli.docs --write {stale}`" in capsys.readouterr().err
    assert docs.main(["--write", str(stale_cli), str(stale_keys)]) == 0
    assert docs.main(["--check", str(stale_cli), str(stale_keys)]) == 0
    written = stale_cli.read_text(encoding="utf-8")
    assert written.startswith("intro\n\n") and written.endswith("\n\nrest\n") and "`--old`" not in written
    assert "| `--keep K` | `checkpoint_keep` |" in written
    keys = stale_keys.read_text(encoding="utf-8")
    assert keys.startswith("keys\n") and keys.endswith("\nend\n") and "`old`" not in keys
    assert "| `ps_threads` | 8 | — |" in keys and "`--keep K`" in keys


def test_the_entry_point_refuses_a_doc_without_markers(tmp_path, capsys):
    unmarked = tmp_path / "plain.md"
    unmarked.write_text("no markers\n", encoding="utf-8")
    assert docs.main(["--check", str(unmarked)]) == 2
    assert "no BEGIN/END markers" in capsys.readouterr().err
    unended = tmp_path / "unended.md"
    unended.write_text(f"{docs.KEYS.begin}\n| `old` |\n", encoding="utf-8")
    assert docs.main(["--write", str(unended)]) == 2
    assert "option keys table" in capsys.readouterr().err
    assert unended.read_text(encoding="utf-8") == f"{docs.KEYS.begin}\n| `old` |\n"


def _anchors(doc) -> set[str]:
    """The anchors a renderer gives doc's headings: lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(encoding="utf-8"), flags=re.M | re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_every_link_of_the_option_tables_leads_to_a_doc_and_its_heading():
    links = re.findall(r"\]\(([^)]+)\)", "\n".join(table.markdown() for table in docs.TABLES))
    assert len(links) > 20
    for link in set(links):  # both docs are in docs/: links are relative to it
        path, _, anchor = link.partition("#")
        doc = ROOT / "docs" / path
        assert doc.is_file(), f"{link}: no {doc}"
        assert not anchor or anchor in _anchors(doc), f"{link}: no such heading in docs/{path}"


def test_defaults_are_written_as_people_write_them():
    shown = {f.name: docs.shown(f) for f in fields(Options)}
    assert (shown["max_table_rows"], shown["max_table_memory_bytes"], shown["max_payload_bytes"]) == (
        "0",  # derived from the machine's memory: its docs row says how (the flag's shown=)
        "0",
        "16 GiB",
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


def test_a_range_is_declared_once_with_its_number_option():
    with pytest.raises(TypeError, match="one of positive=, at_least= or between="):
        option(1, no_flag="tuning", doc="how many", positive=True, at_least=1)
    with pytest.raises(TypeError, match="says= words a range"):
        option(1, no_flag="tuning", doc="how many", says="a few")
    assert range_of(option(1, no_flag="tuning", doc="how many")) is None
    ranged = [f for f in fields(Options) if range_of(f) is not None]
    assert ranged and all(f.type in ("int", "float") and range_of(f).holds(f.default) for f in ranged)


def test_an_option_without_a_meaning_is_refused():
    with pytest.raises(TypeError, match="needs its meaning: doc="):
        option(1, no_flag="tuning")
    with pytest.raises(TypeError, match="the flag's doc"):
        option(1, Flag("--x", "limits", "x"), doc="twice")
    assert meaning_of(option(1, no_flag="tuning", doc="how many")) == "how many"
    undeclared = make_dataclass("Undeclared", [("retries", "int", dataclasses.field(default=2))])
    with pytest.raises(TypeError, match="'retries' has no meaning"):
        docs.key_row(fields(undeclared)[0])


def test_every_option_has_a_meaning_of_its_own():
    meanings = {f.name: meaning_of(f) for f in fields(Options)}
    assert all(meanings.values())
    assert meanings["ps_threads"] == "gRPC request threads of a PS (at least 1)"  # no flag: its doc
    assert "{" not in "".join(meanings.values())  # every help's {default} written in


def test_defaults_in_the_key_table_are_json_with_large_numbers_as_people_read_them():
    shown = {f.name: docs.json_default(f) for f in fields(Options)}
    assert (shown["max_tiered_table_rows"], shown["max_payload_bytes"], shown["max_message_bytes"]) == (
        "17179869184 (2^34)",
        "16 GiB",
        "1 GiB",
    )
    assert (shown["mode"], shown["logdir"], shown["use_stream"], shown["resume"]) == (
        '`"async"`',
        '`""`',
        "`true`",
        "`false`",
    )
    assert (shown["rpc_timeout_s"], shown["max_gradient_magnitude"], shown["progress_fd"]) == ("60", "1e15", "-1")


def test_a_flag_without_docs_words_has_its_help_as_its_row_less_the_default():
    declared = make_dataclass(
        "Declared", [("retries", "int", option(2, Flag("--retries", "limits", "retries (default {default})", "N")))]
    )
    (field,) = fields(declared)
    assert docs.row(field, flag_of(field)) == "| `--retries N` | `retries` | 2 | retries |"
