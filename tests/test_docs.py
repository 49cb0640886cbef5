"""The reference docs agree with the code they describe, so a setting or a wire field cannot change silently.

docs/configuration.md: each settings object's table names every field, with the field's default, and nothing
else: ``PDConnectorConfig`` (``## vLLM PDConnector``, the ``kv_connector_extra_config`` table),
``TransferConfig`` (``## pd_connector control plane``), ``SGLangBackendConfig``'s ``PD_SGLANG_*`` variables
(``## SGLang backend``), ``TransportConfig`` (``## transport``), the router's Structs (``## router``, one table
per TOML table) and ``SchedulerSettings`` (``## scheduler_plugins``). The connector's shared settings
(``pd_connector.settings``) have one definition: each adapter and the engine inherit them unchanged, each table
documents them with that one default, and each transport table names every transport. docs/wire-contract.md names every Struct
and field of ``pd_connector.wire``, and no field, Struct or ``wire.`` name that is not there.
pd_connector/README.md's reading path names only files that exist.

A documented default is the table's first backticked value in the default column, read as JSON, else as a
Python literal, else as text; ``required`` marks a field without a default, and the name of another setting
in the same table (``path``, ``[path]``) a default the code leaves empty to mean that setting's value.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pd_connector import wire
from pd_connector.settings import ConnectorSettings, TransferSettings
from pd_connector.sglang.config import ENV, SGLangBackendConfig
from pd_connector.transfer import TransferConfig
from pd_connector.transport.factory import TRANSPORT_KINDS, TransportConfig
from pd_connector.vllm.config import PDConnectorConfig
from router.config import RouterConfig, WorkerConfig
from scheduler_plugins.config import SchedulerSettings

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REQUIRED = ("required", "(required)")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")


def _section(text: str, heading: str) -> str:
    """The lines under the heading line ``heading`` until the next heading of the same or a higher level."""
    lines = text.splitlines()
    assert heading in lines, f"heading {heading!r} not found"
    level = len(heading) - len(heading.lstrip("#"))
    body: list[str] = []
    for line in lines[lines.index(heading) + 1 :]:
        hashes = len(line) - len(line.lstrip("#"))
        if 0 < hashes <= level and line[hashes : hashes + 1] == " ":
            break
        body.append(line)
    return "\n".join(body)


def _subsections(text: str) -> dict[str, str]:
    """``### title`` -> its body, for every third-level heading in ``text``."""
    titles = [line for line in text.splitlines() if line.startswith("### ")]
    return {title[4:]: _section(text, title) for title in titles}


def _tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table in ``text``: rows as {lower-case header: cell} (``\\|`` inside a cell is kept)."""
    tables: list[list[dict[str, str]]] = []
    block: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if len(block) > 2:
            header, *rows = ([c.strip() for c in _CELL_SPLIT.split(row.strip())[1:-1]] for row in block)
            tables.append([dict(zip((h.lower() for h in header), row, strict=True)) for row in rows[1:]])
        block = []
    return tables


def _defaults_table(text: str) -> dict[str, str]:
    """The one table with a ``default`` column in ``text``: setting -> its documented default."""
    tables = [t for t in _tables(text) if t and "default" in t[0]]
    assert len(tables) == 1, f"expected one table with a default column, found {len(tables)}"
    return {next(iter(row.values())).strip("`"): _first_code(row["default"]) for row in tables[0]}


def _first_code(cell: str) -> str:
    """The first backticked span of a cell (``\\`0\\` (= one alignment unit)`` -> ``0``), else the cell."""
    match = re.search(r"`([^`]*)`", cell)
    return match.group(1) if match else cell


def _literal(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


_NO_DEFAULT = object()


def _code_defaults(cls: type, prefix: str = "") -> dict[str, Any]:
    """Field -> default of a dataclass or msgspec Struct; nested dataclass settings flattened as ``tcp.host``."""
    if dataclasses.is_dataclass(cls):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                value: Any = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = _NO_DEFAULT
            if dataclasses.is_dataclass(value):
                out.update(_code_defaults(type(value), f"{prefix}{f.name}."))
            else:
                out[prefix + f.name] = value
        return out
    return {
        prefix + f.name: (
            f.default
            if f.default is not msgspec.NODEFAULT
            else f.default_factory()
            if f.default_factory is not msgspec.NODEFAULT
            else _NO_DEFAULT
        )
        for f in msgspec.structs.fields(cls)
    }


def _same(documented: Any, default: Any) -> bool:
    if isinstance(default, (tuple, list, frozenset)):
        return isinstance(documented, (list, tuple)) and list(documented) == list(default)
    if isinstance(default, bool) or isinstance(documented, bool):
        return type(documented) is type(default) and documented == default
    return bool(documented == default)


def _disagreements(documented: dict[str, str], code: dict[str, Any]) -> list[str]:
    """What is wrong with a table against the code's fields and defaults (empty when they agree)."""
    errors = [f"{name}: not documented" for name in code.keys() - documented.keys()]
    errors += [f"{name}: documented, but no such setting" for name in documented.keys() - code.keys()]
    for name in documented.keys() & code.keys():
        text, default = documented[name], code[name]
        if default is _NO_DEFAULT or text in REQUIRED:
            if default is not _NO_DEFAULT:
                errors.append(f"{name}: documented as required, code default {default!r}")
            elif text not in REQUIRED:
                errors.append(f"{name}: documented default {text!r}, but the code requires it")
        elif text.strip("[]") in documented:  # "defaults to that setting": the code leaves it empty
            if default not in ("", (), None):
                errors.append(f"{name}: documented as {text!r}'s value, but the code default is {default!r}")
        elif not _same(_literal(text), default):
            errors.append(f"{name}: documented default {text!r}, code default {default!r}")
    return sorted(errors)


@pytest.fixture(scope="module")
def configuration() -> str:
    return (DOCS / "configuration.md").read_text()


@pytest.mark.parametrize(
    ("heading", "cls"),
    [
        ("## vLLM PDConnector", PDConnectorConfig),
        ("## pd_connector control plane", TransferConfig),
        ("## transport", TransportConfig),
        ("## scheduler_plugins", SchedulerSettings),
    ],
)
def test_a_settings_table_lists_every_field_with_its_default(
    configuration: str, heading: str, cls: type
) -> None:
    documented = _defaults_table(_section(configuration, heading))
    assert _disagreements(documented, _code_defaults(cls)) == []


def test_every_router_setting_is_documented_with_its_default(configuration: str) -> None:
    """One ``### [table]`` per TOML table of ``RouterConfig`` (``[[prefill]]`` and ``[[decode]]`` share one),
    the scalar top-level keys under ``### top level``."""
    fields = {f.name: f.type for f in msgspec.structs.fields(RouterConfig)}
    tables = {
        name for name, kind in fields.items() if isinstance(kind, type) and issubclass(kind, msgspec.Struct)
    }
    workers = {name for name, kind in fields.items() if kind == tuple[WorkerConfig, ...]}
    top_level = {n: d for n, d in _code_defaults(RouterConfig).items() if n not in tables | workers}
    errors: list[str] = []
    seen: set[str] = set()
    for title, body in _subsections(_section(configuration, "## router")).items():
        if not any("default" in t[0] for t in _tables(body) if t):
            continue  # not a settings table (the admin API)
        named = re.findall(r"`\[\[?(\w+)\]\]?`", title)
        if title == "top level":
            code, where = top_level, "top level"
        elif set(named) == workers:
            code, where = _code_defaults(WorkerConfig), "[[prefill]]/[[decode]]"
        else:
            assert len(named) == 1 and named[0] in tables, f"### {title}: names no table of RouterConfig"
            code, where = _code_defaults(fields[named[0]]), f"[{named[0]}]"
        seen.update(named or ["top level"])
        errors += [f"{where} {e}" for e in _disagreements(_defaults_table(body), code)]
    assert errors == []
    assert seen == tables | workers | {"top level"}, "a TOML table of RouterConfig has no section"


def test_every_sglang_variable_is_documented_with_its_default(configuration: str) -> None:
    """Each ``PD_SGLANG_*`` row: a variable ``from_env`` reads, and setting it to the documented default (or
    leaving it ``unset``; ``empty`` is the empty string) gives the default configuration."""
    documented = {
        name: text
        for name, text in _defaults_table(_section(configuration, "## SGLang backend")).items()
        if name.startswith("PD_SGLANG_")
    }
    assert set(ENV) == {f.name for f in dataclasses.fields(SGLangBackendConfig)}, "a setting has no variable"
    assert sorted(documented) == sorted(ENV.values())
    for name, text in documented.items():
        env = {} if text == "unset" else {name: "" if text == "empty" else text}
        assert SGLangBackendConfig.from_env(env) == SGLangBackendConfig(), (
            f"{name}: documented default {text!r}"
        )


@pytest.mark.parametrize(
    ("cls", "shared"),
    [
        (PDConnectorConfig, ConnectorSettings),
        (SGLangBackendConfig, ConnectorSettings),
        (TransferConfig, TransferSettings),
    ],
)
def test_the_shared_settings_have_one_definition(cls: type, shared: type) -> None:
    """An adapter's or the engine's settings are the shared ones plus its own: none redefines a shared default."""
    assert issubclass(cls, shared)
    code, one = _code_defaults(cls), _code_defaults(shared)
    assert {name: code[name] for name in one} == one


def test_each_table_documents_the_shared_settings_with_the_one_default(configuration: str) -> None:
    """vLLM's keys and the engine's settings by name, SGLang's as ``PD_SGLANG_*`` variables (read back through
    ``from_env``): every shared setting is there, documented with the default of ``pd_connector.settings``."""
    errors: list[str] = []
    for heading, shared in (
        ("## vLLM PDConnector", ConnectorSettings),
        ("## pd_connector control plane", TransferSettings),
    ):
        documented = _defaults_table(_section(configuration, heading))
        one = _code_defaults(shared)
        errors += [
            f"{heading}: {e}" for e in _disagreements({n: documented[n] for n in one if n in documented}, one)
        ]
    variables = _defaults_table(_section(configuration, "## SGLang backend"))
    for name, default in _code_defaults(ConnectorSettings).items():
        text = variables.get(ENV[name])
        if text is None:
            errors.append(f"## SGLang backend: {ENV[name]} not documented")
            continue
        env = {} if text == "unset" else {ENV[name]: "" if text == "empty" else text}
        if getattr(SGLangBackendConfig.from_env(env), name) != default:
            errors.append(
                f"## SGLang backend: {ENV[name]} documented as {text!r}, the default is {default!r}"
            )
    assert errors == []


@pytest.mark.parametrize(
    ("heading", "setting"),
    [("## vLLM PDConnector", "transport"), ("## SGLang backend", ENV["transport"]), ("## transport", "kind")],
)
def test_every_transport_setting_names_every_transport(
    configuration: str, heading: str, setting: str
) -> None:
    rows = [
        line for line in _section(configuration, heading).splitlines() if line.startswith(f"| `{setting}` |")
    ]
    assert len(rows) == 1, f"{heading}: no single row for {setting}"
    named = {kind for kind in TRANSPORT_KINDS if f"`{kind}`" in rows[0] or f'`"{kind}"`' in rows[0]}
    assert named == set(TRANSPORT_KINDS)


def test_the_checks_see_a_wrong_missing_or_extra_setting() -> None:
    """The comparison fails each way a table can be wrong (so the tests above cannot pass vacuously)."""
    code = {"a_s": 5.0, "flag": False, "names": (), "host": "", "path": _NO_DEFAULT}
    right = {"a_s": "5.0", "flag": "false", "names": "[]", "host": "path", "path": "required"}
    assert _disagreements(right, code) == []
    assert _disagreements({**right, "a_s": "6"}, code) == ["a_s: documented default '6', code default 5.0"]
    assert _disagreements({**right, "flag": "0"}, code) == [
        "flag: documented default '0', code default False"
    ]
    assert _disagreements({**right, "path": "x"}, code) == [
        "path: documented default 'x', but the code requires it"
    ]
    assert _disagreements({**right, "a_s": "required"}, code) == [
        "a_s: documented as required, code default 5.0"
    ]
    assert _disagreements({**right, "host": "other"}, code) == [
        "host: documented default 'other', code default ''"
    ]
    assert _disagreements({**right, "names": "path"}, {**code, "names": ("x",)}) == [
        "names: documented as 'path''s value, but the code default is ('x',)"
    ]
    assert _disagreements({k: v for k, v in right.items() if k != "host"}, code) == ["host: not documented"]
    assert _disagreements({**right, "gone": "1"}, code) == ["gone: documented, but no such setting"]


def _wire() -> tuple[str, set[str], set[str]]:
    """docs/wire-contract.md, and the names of ``pd_connector.wire``'s Structs and of every field they carry."""
    structs = [
        obj
        for obj in vars(wire).values()
        if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj.__module__ == wire.__name__
    ]
    fields = {f for cls in structs for f in cls.__struct_fields__} | wire.TRANSFER_FIELDS
    return (DOCS / "wire-contract.md").read_text(), {cls.__name__ for cls in structs}, fields


def test_the_wire_contract_names_every_struct_and_field() -> None:
    text, structs, fields = _wire()
    words = set(re.findall(r"\w+", text))
    assert structs - words == set(), "Structs missing from docs/wire-contract.md"
    assert fields - words == set(), "fields missing from docs/wire-contract.md"


def test_the_wire_contract_names_nothing_that_is_not_in_the_module() -> None:
    """Backticked CamelCase names are wire's Structs; ``wire.X`` names exist; the transfer fields it spells
    out (``pd_*``, ``do_remote_*``, ``remote_*``, ``bootstrap_*``) are fields of a Struct or TRANSFER_FIELDS."""
    text, structs, fields = _wire()
    assert set(re.findall(r"`([A-Z][a-z]+(?:[A-Z][a-z]+)+)`", text)) - structs == set(), "not wire's Structs"
    assert {n for n in re.findall(r"(?<![\w/])wire\.(?!py\b)(\w+)", text) if not hasattr(wire, n)} == set()
    named = set(re.findall(r"(?<![\w:./])((?:pd|do_remote|remote|bootstrap)_[a-z_]*[a-z])\b", text))
    not_fields = {n for n in named if n.startswith(("pd_router_", "pd_connector", "pd_disagg", "pd_client"))}
    assert named - not_fields - fields == set(), "fields the module does not have"


def test_the_connector_reading_path_names_files_that_exist() -> None:
    """Every file or folder pd_connector/README.md names in backticks exists (``tests/...`` and
    ``integration_tests/...`` from the repository root, the rest from pd_connector/)."""
    readme = ROOT / "pd_connector" / "README.md"
    named = set(re.findall(r"`((?:[\w.]+/)*[\w.]+(?:\.py|/))`", readme.read_text()))
    assert len(named) > 20, "the reading path names the modules it walks through"
    missing = {
        path
        for path in named
        if not (
            ROOT / path if path.startswith(("tests/", "integration_tests/")) else readme.parent / path
        ).exists()
    }
    assert missing == set()
