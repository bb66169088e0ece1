"""KWARM_* parsing: every bad value gets one warning naming the variable, the value and the default."""
from __future__ import annotations

import pytest

from kwarm_ext import config

KNOWN = ("runner", "qwen_gdn", "dsa_indexer")


def parse(**env):
    return config.parse(env, known_families=KNOWN)


def test_defaults():
    s = parse()
    assert (s.enable, s.strict, s.log_level, s.report, s.problems) == (False, False, "INFO", None, ())
    assert all(s.warmups.wants(n) for n in KNOWN) and not s.warmups.forced


@pytest.mark.parametrize("value", ["1", "true", "YES", " On "])
def test_enable_truthy(value):
    assert parse(KWARM_ENABLE=value).enable is True
    assert config.is_enabled({"KWARM_ENABLE": value}) is True


@pytest.mark.parametrize("var, value, expect", [
    ("KWARM_ENABLE", "maybe", "KWARM_ENABLE='maybe' is invalid (expected one of 1/true/yes/on or 0/false/no/off); using the default '0'"),
    ("KWARM_STRICT", "2", "KWARM_STRICT='2' is invalid (expected one of 1/true/yes/on or 0/false/no/off); using the default '0'"),
    ("KWARM_LOG_LEVEL", "LOUD", "KWARM_LOG_LEVEL='LOUD' is invalid (expected one of DEBUG, INFO, WARNING, ERROR); using the default 'INFO'"),
    ("KWARM_WARMUPS", "bogus", "KWARM_WARMUPS='bogus' is invalid (unknown family bogus; known: runner, qwen_gdn, dsa_indexer); using the default '*'"),
    ("KWARM_REPORT", "/", "KWARM_REPORT='/' is invalid (it is a directory; give a file path); no report is written"),
    ("KWARM_REPORT", "/etc/passwd/kwarm/r.json",
     "KWARM_REPORT='/etc/passwd/kwarm/r.json' is invalid (its folder /etc/passwd/kwarm does not exist and cannot be "
     "created in /etc/passwd); no report is written"),
    ("KWARM_MANIFEST", "/etc/passwd/m.json",
     "KWARM_MANIFEST='/etc/passwd/m.json' is invalid (its folder /etc/passwd does not exist and cannot be created "
     "in /etc/passwd); using the default manifest path"),
])
def test_bad_values_each_get_one_clear_problem(var, value, expect):
    s = parse(**{var: value})
    assert s.problems == (expect,)


def test_bad_values_are_logged_once_when_settings_load(kwarm_env, kwarm_log):
    kwarm_env(KWARM_ENABLE="1", KWARM_LOG_LEVEL="loud", KWARM_STRICT="sure")
    config.get()
    config.get()
    warnings = kwarm_log.messages()
    assert len(warnings) == 2
    assert any("KWARM_LOG_LEVEL='loud'" in w for w in warnings)
    assert any("KWARM_STRICT='sure'" in w for w in warnings)


@pytest.mark.parametrize("raw, expect", [(None, None), ("auto", None), (" 31 ", 31), ("1", 1), ("1024", 1024)])
def test_compile_processes(raw, expect):
    s = parse(**({} if raw is None else {"KWARM_COMPILE_PROCESSES": raw}))
    assert s.compile_processes == expect and s.problems == ()
    assert s.as_dict()["KWARM_COMPILE_PROCESSES"] == (expect or "auto")


@pytest.mark.parametrize("raw", ["0", "-3", "many", "2.5", "1025"])
def test_bad_compile_processes_fall_back_to_auto(raw):
    s = parse(KWARM_COMPILE_PROCESSES=raw)
    assert s.compile_processes is None
    assert s.problems == (f"KWARM_COMPILE_PROCESSES={raw!r} is invalid (expected auto or a whole number from 1 "
                          "to 1024); using the default 'auto'",)


def test_warmups_selection():
    only = parse(KWARM_WARMUPS="qwen_gdn").warmups
    assert only.wants("qwen_gdn") and not only.wants("runner") and only.forced == {"qwen_gdn"}
    but = parse(KWARM_WARMUPS="-runner").warmups
    assert not but.wants("runner") and but.wants("qwen_gdn") and not but.forced
    star = parse(KWARM_WARMUPS="*,-dsa_indexer,runner").warmups
    assert star.wants("qwen_gdn") and not star.wants("dsa_indexer") and star.forced == {"runner"}
    assert star.describe() == "*,runner,-dsa_indexer"


def test_partly_bad_warmups_keep_the_good_part():
    s = parse(KWARM_WARMUPS="qwen_gdn,nope")
    assert s.warmups.wants("qwen_gdn") and not s.warmups.wants("runner")
    assert len(s.problems) == 1 and "nope" in s.problems[0]


def test_readme_configuration_table_matches_the_variables():
    from conftest import REPO

    readme = (REPO / "README.md").read_text()
    for name, doc in config.VARIABLES.items():
        assert f"| `{name}` | {doc} |" in readme, f"README's table is out of date for {name}"


def test_frontend_is_a_selectable_name_not_a_worker_family():
    from kwarm_ext import families

    assert "frontend" not in families.FAMILIES, "the worker's warmup never plans the front end"
    settings = config.parse({"KWARM_WARMUPS": "frontend"})
    assert settings.problems == () and settings.warmups.wants("frontend")
    assert not settings.warmups.wants("runner")


@pytest.mark.parametrize("var, raw, message", [
    ("KWARM_WARMUPS", "-nosuch,qwen_gdn", "using 'qwen_gdn'"),
    ("KWARM_WARMUPS", "*,-runner,bogus", "using '*,-runner'"),
    ("KWARM_WARMUPS", "-*,bogus", "using '-*'"),
    ("KWARM_WARMUPS", "bogus", "using the default '*'"),
    ("KWARM_ALLOW_MODULES", "os,../x,", "using 'os'"),
    ("KWARM_ALLOW_MODULES", "../x", "using the default ''"),
])
def test_a_warning_names_the_value_in_force(var, raw, message):
    known = ("runner", "qwen_gdn", "dsa_indexer")
    s = config.parse({var: raw}, known_families=known)
    (problem,) = s.problems
    assert problem.endswith(message), problem
    if var == "KWARM_WARMUPS" and message != "using the default '*'":
        in_force = message.split("'")[1]
        assert [n for n in known if s.warmups.wants(n)] == \
            [n for n in known if config.parse({var: in_force}, known_families=known).warmups.wants(n)]


def test_a_missing_folder_kwarm_can_create_is_no_problem(tmp_path):
    """kwarm creates a report's or manifest's missing folder when it writes: only one it cannot create
    (its nearest existing folder is not writable, or is a file) is a problem, said at start."""
    s = parse(KWARM_REPORT=str(tmp_path / "a" / "b" / "r.json"), KWARM_MANIFEST=str(tmp_path / "m" / "m.json"))
    assert s.problems == () and s.report == str(tmp_path / "a" / "b" / "r.json")


@pytest.mark.parametrize("var,raw,field,expect,described", [
    ("KWARM_BUDGET", "0", "budget", ("seconds", 0.0), "0 s"),
    ("KWARM_BUDGET", "0%", "budget", ("percent", 0.0), "0%"),
    ("KWARM_BUDGET", "1000%", "budget", ("percent", 1000.0), "1000%"),
    ("KWARM_BUDGET", "86400s", "budget", ("seconds", 86400.0), "86400 s"),
    ("KWARM_BUDGET", "2%", "budget", ("percent", 2.0), "auto"),  # the default, said as such
    ("KWARM_LEARN_INTERVAL", "0", "learn_interval", 0.0, 0.0),
    ("KWARM_LEARN_INTERVAL", "86400", "learn_interval", 86400.0, 86400.0),
    ("KWARM_REPLAY_LIMIT", "0", "replay_limit", 0.0, 0.0),
    ("KWARM_REPLAY_LIMIT", "86400", "replay_limit", 86400.0, 86400.0),
])
def test_the_ends_of_each_range_are_accepted(var, raw, field, expect, described):
    s = parse(**{var: raw})
    assert (getattr(s, field), s.problems) == (expect, ())
    assert s.as_dict()[var] == described


@pytest.mark.parametrize("var,raw", [("KWARM_BUDGET", "1000.5%"), ("KWARM_BUDGET", "86401"),
                                     ("KWARM_LEARN_INTERVAL", "86400.5"), ("KWARM_REPLAY_LIMIT", "86400.5"),
                                     ("KWARM_REPLAY_LIMIT", "-0.1")])
def test_just_past_each_range_is_one_problem(var, raw):
    s = parse(**{var: raw})
    assert len(s.problems) == 1 and var in s.problems[0]
