"""The configuration, pure and fast: defaults, file + environment precedence, errors, secrets."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from cdc.cli import main
from cdc.config import (
    INT32_MAX,
    SETTINGS,
    Config,
    ConfigError,
    as_dict,
    load,
    secrets_of,
    settings_markdown,
)
from cdc.redact import Redactor, dsn_secrets, redact_dsn


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cdc.toml"
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------------- defaults


def test_defaults_without_file_or_environment():
    config = load(None, environ={})
    assert config == Config()
    assert config.source.dsn == "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
    assert (config.source.slot, config.source.publication, config.source.tables) == ("cdc", "cdc", ["public.*"])
    assert (config.source.protocol_version, config.source.streaming) == (1, False)
    assert config.topic.bootstrap_servers == "127.0.0.1:9092"
    assert (config.topic.prefix, config.topic.partitions, config.topic.replication_factor) == ("cdc", 1, 1)
    assert config.topic.table_partitions == []
    assert config.topic.allow_non_compacted is False
    assert config.events.schemas is False
    assert (config.daemon.metrics_port, config.daemon.log_level) == (0, "INFO")


def test_empty_file_is_the_defaults(tmp_path):
    assert load(write(tmp_path, ""), environ={}) == Config()


def test_list_defaults_are_not_shared():
    a, b = Config(), Config()
    a.source.tables.append("x.y")
    assert b.source.tables == ["public.*"]


# ------------------------------------------------------------------ file + environment


def test_file_values(tmp_path):
    path = write(tmp_path, """
[source]
dsn = "host=db user=cdc dbname=app"
tables = ["public.orders", '"My Schema".*']
streaming = true
protocol_version = 2
slot_wait_s = 2

[topic]
prefix = "dbserver1"
partitions = 6
allow_non_compacted = true

[events]
schemas = true
""")
    config = load(path, environ={})
    assert config.source.dsn == "host=db user=cdc dbname=app"
    assert config.source.tables == ["public.orders", '"My Schema".*']
    assert (config.source.streaming, config.source.protocol_version) == (True, 2)
    assert config.source.slot_wait_s == 2.0 and isinstance(config.source.slot_wait_s, float)
    assert (config.topic.prefix, config.topic.partitions, config.topic.allow_non_compacted) == ("dbserver1", 6, True)
    assert config.events.schemas is True


def test_environment_overrides_the_file(tmp_path):
    path = write(tmp_path, '[source]\ndsn = "host=file"\nslot = "from_file"\n[topic]\npartitions = 6\n')
    config = load(path, environ={"CDC_SOURCE_DSN": "host=env dbname=x", "CDC_TOPIC_PARTITIONS": "12"})
    assert config.source.dsn == "host=env dbname=x"  # env wins
    assert config.topic.partitions == 12
    assert config.source.slot == "from_file"  # not overridden: the file's value stays


def test_environment_without_a_file():
    config = load(None, environ={"CDC_SOURCE_DSN": "postgresql://u@h/db", "CDC_TOPIC_PREFIX": "p1"})
    assert (config.source.dsn, config.topic.prefix) == ("postgresql://u@h/db", "p1")


def test_load_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("CDC_TOPIC_PREFIX", "from_os")
    assert load().topic.prefix == "from_os"


@pytest.mark.parametrize(
    "value, expected",
    [
        ('public.a, "x,y".b', ["public.a", '"x,y".b']),  # commas inside quotes belong to the name
        ('["a.b"]', ["a.b"]),  # a TOML/JSON array
        ('["a.b", "\\"q,r\\".*"]', ["a.b", '"q,r".*']),
        ("public.a,", ["public.a"]),  # empty items are dropped
        ("  public.a ,public.b  ", ["public.a", "public.b"]),
    ],
)
def test_environment_table_lists(value, expected):
    assert load(None, environ={"CDC_SOURCE_TABLES": value}).source.tables == expected


def test_environment_table_list_that_is_empty():
    with pytest.raises(ConfigError, match=r"^\[source\] tables is empty: list the tables to capture"):
        load(None, environ={"CDC_SOURCE_TABLES": " , "})


def test_environment_table_list_with_non_strings():
    with pytest.raises(ConfigError) as err:
        load(None, environ={"CDC_SOURCE_TABLES": "[1, 2]"})
    assert str(err.value) == (
        "CDC_SOURCE_TABLES = '[1, 2]' is not a list of strings: set it to one, e.g. CDC_SOURCE_TABLES=public.*"
    )


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "yes", "on", " On "])
def test_environment_booleans_true(text):
    assert load(None, environ={"CDC_EVENTS_SCHEMAS": text}).events.schemas is True


@pytest.mark.parametrize("text", ["0", "false", "False", "no", "off"])
def test_environment_booleans_false(text, tmp_path):
    path = write(tmp_path, "[events]\nschemas = true\n")
    assert load(path, environ={"CDC_EVENTS_SCHEMAS": text}).events.schemas is False


def test_environment_boolean_that_is_neither():
    with pytest.raises(ConfigError) as err:
        load(None, environ={"CDC_EVENTS_SCHEMAS": "maybe"})
    assert str(err.value) == "CDC_EVENTS_SCHEMAS = 'maybe' is not true or false: set it to one, e.g. CDC_EVENTS_SCHEMAS=false"


def test_file_booleans_must_be_toml_booleans(tmp_path):
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, "[events]\nschemas = 1\n"), environ={})
    assert str(err.value) == "[events] schemas = 1 is not true or false: set it to one, e.g. schemas = false"


def test_environment_numbers():
    config = load(None, environ={"CDC_TOPIC_PARTITIONS": " 7 ", "CDC_SOURCE_SLOT_WAIT_S": "0.5"})
    assert (config.topic.partitions, config.source.slot_wait_s) == (7, 0.5)


def test_unrelated_environment_is_ignored():
    """Other tools' CDC_* variables (tests, local services) are not config keys."""
    environ = {"CDC_PG_BIN": "/x", "CDC_TEST_BOOTSTRAP_SERVERS": "h:1", "CDC_NOIDA_DB_BIN": "/y", "CDCX": "1"}
    assert load(None, environ=environ) == Config()


def test_misspelt_environment_variable_is_an_error():
    with pytest.raises(ConfigError) as err:
        load(None, environ={"CDC_TOPIC_PARTITION": "6"})
    assert str(err.value) == (
        "unknown environment variable CDC_TOPIC_PARTITION: did you mean CDC_TOPIC_PARTITIONS? "
        "(remove it or fix the spelling)"
    )


def test_lower_case_environment_variable_is_an_error():
    """Variable names are case-sensitive: the lower-case one would be silently ignored."""
    with pytest.raises(ConfigError, match="did you mean CDC_TOPIC_PREFIX"):
        load(None, environ={"CDC_TOPIC_prefix": "x"})


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[topic]\nprefixx = 'a'\n", "unknown key 'prefixx' in [topic]: did you mean 'prefix'? (remove it or fix the spelling)"),
        ("[daemon]\nzzz = 1\n", "unknown key 'zzz' in [daemon]: remove it (known keys: log_format, log_level, max_pending_records, "
                                "metrics_host, metrics_interval_s, metrics_port, spill_dir)"),
        ("[topics]\n", "unknown section [topics] in {path}: did you mean [topic]? (remove it or fix the spelling)"),
        ("[topic]\npartitions = 'x'\n", "[topic] partitions = 'x' is not a whole number: set it to one, e.g. partitions = 1"),
        ("[topic]\npartitions = 2.5\n", "[topic] partitions = 2.5 is not a whole number: set it to one, e.g. partitions = 1"),
        ("[topic]\npartitions = true\n", "[topic] partitions = true is not a whole number: set it to one, e.g. partitions = 1"),
        ("[topic]\npartitions = 0\n", "[topic] partitions must be at least 1"),
        ("[topic]\nprefix = 7\n", '[topic] prefix = 7 is not a string: set it to one, e.g. prefix = "cdc"'),
        ("[source]\ntables = 'public.x'\n", None),  # a single string is a one-item list
        ("[source]\ntables = [1]\n", '[source] tables = [1] is not a list of strings: set it to one, e.g. tables = ["public.*"]'),
        ("[source]\ntables = ['public']\n", "table pattern 'public' has no schema: write it as schema.table, e.g. public.orders"),
        ("[source]\ntables = ['*.x']\n", "table pattern '*.x' has a wildcard schema"),
        ("[source]\nprotocol_version = 3\n", "[source] protocol_version must be 1 or 2"),
        ("[source]\nslot_wait_s = -1\n", "[source] slot_wait_s must be at least 0"),
        ("[daemon]\nmetrics_port = 70000\n", "[daemon] metrics_port must be a TCP port (0 to 65535; 0 turns metrics off)"),
        ("[topic]\nclient = 'librdkafka'\n", '[topic] client must be "kafka-python" or "confluent"'),
        ("[topic]\nbootstrap_servers = ' '\n", "[topic] bootstrap_servers is empty: set it to host:port of the broker"),
        ("[topic]\nprefix = ''\n", "topic prefix is empty: set it to a short name, e.g. dbserver1"),
        ("[source]\npublication = 'a-b'\n", "[source] publication 'a-b' must be lower-case letters"),
        ("topic = 'x'\n", "[topic] in {path} must be a table: write it as a [topic] section"),
    ],
)
def test_file_errors(tmp_path, text, expected):
    path = write(tmp_path, text)
    if expected is None:
        load(path, environ={})
        return
    with pytest.raises(ConfigError) as err:
        load(path, environ={})
    message = str(err.value)
    assert message.startswith(expected.format(path=path)), message
    assert "\n" not in message


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match=r"not found: pass an existing file to --config$"):
        load(tmp_path / "absent.toml", environ={})
    with pytest.raises(ConfigError, match=r"\(Is a directory\): pass a readable TOML file to --config$"):
        load(tmp_path, environ={})
    (tmp_path / "latin1.toml").write_bytes(b"# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text: save it as UTF-8$"):
        load(tmp_path / "latin1.toml", environ={})
    with pytest.raises(ConfigError, match=r"is not valid TOML: "):
        load(write(tmp_path, "[topic\n"), environ={})


def test_secret_values_never_appear_in_errors(tmp_path):
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, "[topic]\nsasl_password = 424242\n"), environ={})
    assert "424242" not in str(err.value) and "<hidden>" in str(err.value)


# ----------------------------------------------------------------- secrets in output


@pytest.mark.parametrize(
    "dsn, shown",
    [
        ("host=db user=cdc password=s3cret dbname=app", "host=db user=cdc password=*** dbname=app"),
        ("host=db password='s3 cret' dbname=app", "host=db password=*** dbname=app"),
        ("postgresql://cdc:s3cret@db:5432/app", "postgresql://cdc:***@db:5432/app"),
        ("postgres://cdc:s3cret@db/app?sslmode=require", "postgres://cdc:***@db/app?sslmode=require"),
        ("host=db user=cdc dbname=app", "host=db user=cdc dbname=app"),
    ],
)
def test_as_dict_masks_secrets(dsn, shown):
    config = load(None, environ={"CDC_SOURCE_DSN": dsn, "CDC_TOPIC_SASL_PASSWORD": "kafka-s3cret"})
    out = as_dict(config)
    assert out["source"]["dsn"] == shown
    assert out["topic"]["sasl_password"] == "<hidden>"
    assert "s3cret" not in json.dumps(out)
    raw = as_dict(config, hide_secrets=False)
    assert (raw["source"]["dsn"], raw["topic"]["sasl_password"]) == (dsn, "kafka-s3cret")
    assert config.source.dsn == dsn  # masking works on a copy


def test_as_dict_leaves_an_empty_sasl_password_empty():
    assert as_dict(Config())["topic"]["sasl_password"] == ""


def test_cdc_config_prints_the_masked_configuration(tmp_path):
    path = write(tmp_path, '[source]\ndsn = "postgresql://cdc:s3cret@db/app"\n[topic]\nsasl_password = "k-s3cret"\n')
    result = CliRunner().invoke(main, ["config", "--config", str(path)], env={"CDC_TOPIC_PARTITIONS": "9"})
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["source"]["dsn"] == "postgresql://cdc:***@db/app"
    assert out["topic"]["sasl_password"] == "<hidden>"
    assert out["topic"]["partitions"] == 9
    assert "s3cret" not in result.output


def test_cdc_config_error_is_one_line(tmp_path):
    path = write(tmp_path, "[topic]\npartitions = 'many'\n")
    result = CliRunner().invoke(main, ["config", "--config", str(path)])
    assert result.exit_code == 1
    assert result.output == (
        "error: [topic] partitions = 'many' is not a whole number: set it to one, e.g. partitions = 1\n"
    )


# --------------------------------------------------------------------------- redaction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("password=s3cret", "password=***"),
        ("host=h PASSWORD = s3cret port=5", "host=h PASSWORD = *** port=5"),
        ("host=h password='s3 cr\\'et' port=5", "host=h password=*** port=5"),
        ("postgresql://u:s3cret@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("postgresql://u:p%40ss@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),  # no password: unchanged
        ("postgresql://h/db?password=s3cret", "postgresql://h/db?password=***"),
        ("failed (dsn was postgresql://u:s3cret@h/db) and host=h password=x2", "failed (dsn was postgresql://u:***@h/db) and host=h password=***"),
        ("no secrets here", "no secrets here"),
    ],
)
def test_redact_dsn(text, expected):
    assert redact_dsn(text) == expected


def test_redact_dsn_is_idempotent_on_a_whole_dsn():
    for dsn in ("host=h password=s3cret", "postgresql://u:s3cret@h/db", "host=h password='a b'"):
        once = redact_dsn(dsn)
        assert redact_dsn(once) == once and "s3cret" not in once


def test_redact_dsn_keeps_query_parameters_after_the_password():
    assert redact_dsn("postgresql://h/db?password=s3cret&sslmode=require") == "postgresql://h/db?password=***&sslmode=require"


# -------------------------------------------------------------- the settings table



def test_the_docs_table_is_the_settings_table():
    """The docs' configuration table is generated from the settings table (`cdc config --settings`)."""
    page = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text(encoding="utf-8")
    begin = page.index("<!-- settings table:")
    table = page[page.index("\n", begin) + 1:page.index("\n<!-- end of settings table -->")]
    assert table == settings_markdown(), "regenerate it: python -m cdc config --settings"
    result = CliRunner().invoke(main, ["config", "--settings"], env={})
    assert result.exit_code == 0 and result.output == settings_markdown() + "\n"


def test_every_setting_has_help_and_valid_default():
    assert {(s.section, s.key) for s in SETTINGS} == {
        (section, key) for section, values in as_dict(Config(), hide_secrets=False).items() for key in values
    }
    for s in SETTINGS:
        assert s.help, s
        assert s.read(s.default, False) == s.default, s  # the default passes its own checks


def _invalid_values(s, from_env: bool) -> dict[str, object]:
    """Values of each class a user gets wrong, spelt as the file (TOML values) or the environment writes them."""
    out: dict[str, object] = {}
    if s.kind is bool:
        out["wrong type"] = "maybe" if from_env else 1
    elif s.kind is int:
        out["wrong type"] = "2.5" if from_env else 2.5
        out["not a number"] = "x"
        out["empty"] = ""
    elif s.kind is float:
        out["wrong type"] = "soon" if from_env else True
        out["not finite"] = "nan" if from_env else float("nan")
    elif s.kind is str and not from_env:
        out["wrong type"] = 7
    elif s.kind == list[str]:
        out["wrong type"] = "[1]" if from_env else [1]
        if s.default:  # a list whose default is empty may be empty
            out["empty"] = "" if from_env else []
        if s.sample is not None:
            out["not its form"] = "public.orders:6" if from_env else ["public.orders:6"]
    if s.kind is str and not s.optional:
        out["empty"] = ""
    if s.kind in (int, float) and s.low is not None:
        out["below range"] = s.low - 1
    if s.kind is int:
        out["above range"] = (s.high if s.high is not None else INT32_MAX) + 1
    if s.kind is float and s.high is not None:
        out["above range"] = s.high * 2
    for choice in s.choices:
        if isinstance(choice, str) and choice:
            out["typo of a choice"] = choice[:-1] + ("x" if choice[-1] != "x" else "y")
        elif isinstance(choice, int):
            out["not a choice"] = max(s.choices) + 1
    if from_env:
        out = {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in out.items()}
    return out


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


WALK = [
    (s, from_env, case, value)
    for s in SETTINGS
    for from_env in (False, True)
    for case, value in _invalid_values(s, from_env).items()
]


@pytest.mark.parametrize(
    "setting, from_env, case, value", WALK,
    ids=[f"{s.section}.{s.key}-{'env' if e else 'file'}-{c}" for s, e, c, _ in WALK],
)
def test_every_setting_refuses_invalid_values(tmp_path, setting, from_env, case, value):
    """Generated from the table: exit 1, one `error:` line naming the key, no traceback."""
    if from_env:
        path, env = write(tmp_path, ""), {setting.env: value}
    else:
        path, env = write(tmp_path, f"[{setting.section}]\n{setting.key} = {_toml_value(value)}\n"), {}
    result = CliRunner().invoke(main, ["config", "--config", str(path)], env=env)
    assert result.exit_code == 1, (result.output, result.exception)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    named = (setting.env, f"[{setting.section}] {setting.key}", f"{setting.section} {setting.key}")
    assert any(n in lines[0] for n in named), lines[0]
    if setting.secret is True:
        assert str(value) not in lines[0]


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"CDC_TOPIC_PARTITIONS": str(2**31)}, "CDC_TOPIC_PARTITIONS = 2147483648 is too large: the most is 2147483647"),
        ({"CDC_TOPIC_TABLE_PARTITIONS": "public.orders=6,public.items"},
         "CDC_TOPIC_TABLE_PARTITIONS has 'public.items', which is not schema.table=count with a count of at least 1: "
         'write each entry as "schema.table=count" or "schema.*=count", e.g. ["public.orders=6"]'),
        ({"CDC_TOPIC_TABLE_PARTITIONS": "public.orders=0"}, "CDC_TOPIC_TABLE_PARTITIONS has 'public.orders=0', which is"),
        ({"CDC_TOPIC_TABLE_PARTITIONS": "orders=6"},
         "CDC_TOPIC_TABLE_PARTITIONS: table pattern 'orders' has no schema: write it as schema.table"),
        ({"CDC_TOPIC_BOOTSTRAP_SERVERS": "kafka:90x2"}, "CDC_TOPIC_BOOTSTRAP_SERVERS has 'kafka:90x2', which is not host:port"),
        ({"CDC_TOPIC_BOOTSTRAP_SERVERS": "a:9092,b"}, "CDC_TOPIC_BOOTSTRAP_SERVERS has 'b', which is not host:port"),
        ({"CDC_TOPIC_BOOTSTRAP_SERVERS": "a:0"}, "CDC_TOPIC_BOOTSTRAP_SERVERS has 'a:0', which is not host:port"),
        ({"CDC_TOPIC_DELIVERY_TIMEOUT_MS": "0"}, "CDC_TOPIC_DELIVERY_TIMEOUT_MS must be at least 1"),
        ({"CDC_TOPIC_DELIVERY_TIMEOUT_MS": "6"}, "[topic] delivery_timeout_ms = 6 leaves no time to send after linger_ms = 5"),
        ({"CDC_TOPIC_SECURITY_PROTOCOL": "SASL_SSLL"},
         'CDC_TOPIC_SECURITY_PROTOCOL must be "PLAINTEXT", "SSL", "SASL_PLAINTEXT" or "SASL_SSL", not \'SASL_SSLL\': '
         "did you mean SASL_SSL?"),
        ({"CDC_TOPIC_SECURITY_PROTOCOL": "SASL_SSL"}, "[topic] security_protocol = SASL_SSL needs sasl_mechanism"),
        ({"CDC_TOPIC_SASL_MECHANISM": "SCRAM-SHA-256"}, "[topic] sasl_mechanism is set but security_protocol = PLAINTEXT"),
        ({"CDC_TOPIC_SECURITY_PROTOCOL": "SASL_SSL", "CDC_TOPIC_SASL_MECHANISM": "SCRAM-SHA256", "CDC_TOPIC_SASL_USERNAME": "u"},
         "CDC_TOPIC_SASL_MECHANISM must be \"PLAIN\", \"SCRAM-SHA-256\" or \"SCRAM-SHA-512\", not 'SCRAM-SHA256': "
         "did you mean SCRAM-SHA-256?"),
        ({"CDC_TOPIC_SECURITY_PROTOCOL": "SSL", "CDC_TOPIC_SSL_CAFILE": "/nonexistent/ca.pem"},
         "CDC_TOPIC_SSL_CAFILE = /nonexistent/ca.pem does not exist: point it at the PEM file, or leave it empty"),
        ({"CDC_TOPIC_SSL_CAFILE": "/"}, "CDC_TOPIC_SSL_CAFILE = / is not a file"),
        ({"CDC_DAEMON_SPILL_DIR": "/proc/version/x"}, "CDC_DAEMON_SPILL_DIR = /proc/version/x is not a directory"),
        ({"CDC_SOURCE_SLOT_WAIT_S": "inf"}, "CDC_SOURCE_SLOT_WAIT_S = inf is not a finite number"),
        ({"CDC_EVENTS_SKIPPED_OPERATIONS": "d,t"}, "CDC_EVENTS_SKIPPED_OPERATIONS = 'd,t': cdc skips only truncates"),
        ({"CDC_EVENTS_SKIPPED_OPERATIONS": "truncate"}, "CDC_EVENTS_SKIPPED_OPERATIONS must be \"none\" or \"t\", not 'truncate'"),
    ],
)
def test_values_checked_when_read(environ, expected):
    with pytest.raises(ConfigError) as err:
        load(None, environ=environ)
    assert str(err.value).startswith(expected), str(err.value)


def test_spill_dir_not_writable(tmp_path):
    if os.geteuid() == 0:  # root may write anywhere a mode forbids, but not into procfs
        locked = Path("/proc/sys")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=rf"^CDC_DAEMON_SPILL_DIR = {locked}/spill: {locked} is not writable"):
        load(None, environ={"CDC_DAEMON_SPILL_DIR": str(locked / "spill")})


def test_case_insensitive_choices_are_kept_upper_case(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    config = load(None, environ={
        "CDC_TOPIC_SECURITY_PROTOCOL": "sasl_ssl", "CDC_TOPIC_SASL_MECHANISM": "scram-sha-512",
        "CDC_TOPIC_SASL_USERNAME": "u", "CDC_TOPIC_SSL_CAFILE": str(ca), "CDC_DAEMON_LOG_LEVEL": "debug",
    })
    assert (config.topic.security_protocol, config.topic.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-512")
    assert config.daemon.log_level == "DEBUG"


def test_table_partitions_give_busy_tables_their_count_and_the_rest_the_default():
    config = load(None, environ={
        "CDC_TOPIC_PARTITIONS": "2", "CDC_TOPIC_TABLE_PARTITIONS": 'public.orders=12,"Sales".*=4,public.*=3',
    })
    topic = config.topic
    assert topic.table_partitions == ["public.orders=12", '"Sales".*=4', "public.*=3"]
    assert [topic.partitions_of(*t) for t in (("public", "orders"), ("public", "items"), ("Sales", "x"), ("sales", "x"),
                                              ("other", "x"))] == [12, 3, 4, 2, 2]
    quoted = load(None, environ={"CDC_TOPIC_TABLE_PARTITIONS": '["public.\\"a=b\\"=5"]'}).topic
    assert quoted.partitions_of("public", "a=b") == 5  # the count is after the last `=`


def test_skipped_operations():
    assert Config().events.skipped_operations == "none"
    assert load(None, environ={"CDC_EVENTS_SKIPPED_OPERATIONS": "t"}).events.skipped_operations == "t"


# ------------------------------------------------------------ secrets by value

HARD_PASSWORDS = [
    "pa%ss", "pa ss word", "pa'ss\"wd", "p@ss@word", "pa=ss", "pa/ss/wd", "pa\\ss", "pa:ss", "pässwörd€",
    "%zz q'@=/\\:é",
]


def _uri(password: str) -> str:
    from urllib.parse import quote

    return f"postgresql://cdc:{quote(password, safe='')}@db.internal:5432/app"


def _kv(password: str) -> str:
    return "host=db.internal user=cdc password='" + password.replace("\\", "\\\\").replace("'", "\\'") + "' dbname=app"


@pytest.mark.parametrize("password", HARD_PASSWORDS)
@pytest.mark.parametrize("form", [_uri, _kv], ids=["uri", "key-value"])
def test_dsn_password_is_masked_by_value(password, form):
    """However the DSN spells it, the password is found, and removed from any text that holds it."""
    from psycopg.conninfo import conninfo_to_dict

    dsn = form(password)
    assert conninfo_to_dict(dsn)["password"] == password
    mask = Redactor(dsn_secrets(dsn))
    for text in (
        dsn, f"error: {password}!", f"({password!r})", json.dumps({"p": password}), json.dumps(password, ensure_ascii=True),
        f'invalid "{password}"', f"u:{password}@h",
    ):
        assert password not in mask(text), text
        assert "***" in mask(text)
    assert mask("nothing secret here: db.internal, cdc, app") == "nothing secret here: db.internal, cdc, app"


@pytest.mark.parametrize(
    "dsn, secret",
    [
        ("postgresql://cdc:p%zz-secret@db/app", "p%zz-secret"),  # '%' not percent-encoded: libpq quotes it whole
        ("postgresql://cdc:pass word@db/app", "pass word"),  # a space in a URI
        ("host=db password=pass word1 dbname=app", "word1"),  # unquoted space: libpq quotes the second part
        ("host=db password='unterminated dbname=app", "unterminated"),
        ("postgresql://cdc:p/sec@db/app", "p/sec"),  # '/' unencoded: libpq reads host cdc, port "p"
    ],
)
def test_dsn_that_does_not_parse_as_meant_is_never_echoed(dsn, secret):
    """libpq's own error text quotes the malformed part: masked by value, whatever it quotes."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    mask = Redactor(dsn_secrets(dsn))
    try:
        message = str(psycopg.connect(dsn + " connect_timeout=1" if "://" not in dsn else dsn, connect_timeout=1))
    except psycopg.Error as exc:
        message = str(exc)
    with contextlib.suppress(psycopg.Error):
        message += str(conninfo_to_dict(dsn))
    for piece in {secret, *secret.replace("/", " ").split()}:
        assert not re.search(rf"(?<![^\W_]){re.escape(piece)}(?![^\W_])", mask(message)), (mask(message), piece)


def test_secrets_of_reads_the_table():
    config = load(None, environ={
        "CDC_SOURCE_DSN": "host=h password=pg-secret", "CDC_TOPIC_SASL_PASSWORD": "kafka-secret",
    })
    assert set(secrets_of(config)) == {"pg-secret", "kafka-secret"}
    shown = json.dumps(as_dict(config))
    assert "pg-secret" not in shown and "kafka-secret" not in shown


@pytest.mark.parametrize("password", HARD_PASSWORDS)
@pytest.mark.parametrize("where", ["file", "env"])
def test_cdc_config_never_shows_the_password(tmp_path, password, where):
    dsn = _kv(password)
    env = {"CDC_TOPIC_SASL_PASSWORD": password}
    if where == "env":
        env["CDC_SOURCE_DSN"] = dsn
        path = write(tmp_path, "")
    else:
        path = write(tmp_path, f"[source]\ndsn = {json.dumps(dsn)}\n")
    result = CliRunner().invoke(main, ["config", "--config", str(path)], env=env)
    assert result.exit_code == 0, result.output
    assert password not in result.output and json.dumps(password)[1:-1] not in result.output
