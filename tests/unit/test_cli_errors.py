"""The command line's errors: exit 2 with one line or the command's own usage, never a traceback,
and no flag taken for another by its first letters."""

import signal

import pytest

from paramserver.launch import cli


@pytest.fixture(autouse=True)
def _keep_signal_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("flags, said", [(["--workers", "0"], "got 1 and 0"), (["--ps", "0"], "got 0 and 1")])
def test_no_ps_or_no_worker_is_one_line_and_exit_2(capsys, tmp_path, flags, said):
    script = tmp_path / "train.py"
    script.write_text("")
    assert cli.main(["run", *flags, str(script)]) == 2
    err = capsys.readouterr().err
    assert err == f"paramserver: error: --ps and --workers must be at least 1, {said}\n"


def test_a_missing_script_is_refused_before_any_process_starts(capsys, tmp_path):
    assert cli.main(["run", str(tmp_path / "nothing.py")]) == 2
    assert capsys.readouterr().err == f"paramserver: error: training script {tmp_path / 'nothing.py'} does not exist\n"


@pytest.mark.parametrize("argv, command", [(["run", "--bogus", "x.py"], "run"), (["status", "--bogus"], "status"),
                                           (["run", "--work", "2", "x.py"], "run")])
def test_an_unknown_or_abbreviated_flag_shows_the_commands_usage(capsys, argv, command):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: paramserver {command} ")
    assert f"paramserver {command}: error: unrecognized arguments: {argv[1]}" in err


def test_the_top_level_flags_take_no_abbreviation_either(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--log-l", "DEBUG", "status"])
    assert "paramserver: error:" in capsys.readouterr().err


def test_bind_alone_asks_for_the_ps_role(capsys, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("PARAMSERVER_CLUSTER", raising=False)
    assert cli.main(["node", "--bind", "127.0.0.1:0"]) == 2
    assert capsys.readouterr().err == "paramserver: error: --bind is where a PS listens: give --role ps too\n"


def test_every_flag_of_run_is_in_the_run_table_of_docs_cli_md():
    from tests.conftest import ROOT

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    table = text[text.index("## `paramserver run"):text.index("## `paramserver demo")]
    run = cli.command_parsers(cli.build_parser())["run"]
    flags = {flag for action in run._actions for flag in action.option_strings
             if flag.startswith("--") and flag != "--help"}
    assert sorted(flag for flag in flags if f"`{flag}" not in table) == []
