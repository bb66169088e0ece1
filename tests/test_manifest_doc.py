"""docs/manifest.md against the code: its example manifest is accepted by the real parser
(``kwarm_ext.manifest.parse``) with its entries and no problems, and every top-level field its
table lists is one the parser reads or a manifest written from the parse holds; the fields the
table calls required refuse the file when missing, the others do not (issue 63, item 5)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import require
from kwarm_ext import manifest
from kwarm_ext.manifest import BadManifest

require("triton")  # an entry's attributes are checked against its key with Triton's own rules

DOC = Path(__file__).resolve().parent.parent / "docs" / "manifest.md"


def example_text() -> str:
    found = re.search(r"```json\n(.*?)\n```", DOC.read_text(), re.S)
    assert found, "docs/manifest.md has no ```json block"
    return found.group(1)


def top_level_table() -> dict:
    """Field name -> required ("yes"/"no"), from the table under "## Top-level fields"."""
    section = DOC.read_text().split("## Top-level fields", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| [^|]+ \| (yes|no) \|", section, re.M)
    assert rows, "no field table under \"## Top-level fields\""
    return dict(rows)


def test_the_example_is_accepted_with_its_entries_and_no_problems():
    parsed = manifest.parse(example_text())
    assert parsed.problems == [] and parsed.more_problems == 0
    assert len(parsed.entries) == 1 and len(parsed.autotune) == 1
    assert parsed.token_counts and parsed.surface_items() == 1
    assert parsed.stamp.triton and parsed.stamp.arch


def test_every_documented_top_level_field_is_the_code_s():
    table = top_level_table()
    example = json.loads(example_text())
    written = manifest.parse(example_text()).as_json()  # what a save writes from this parse
    for field in table:
        assert field in example, f"the example lacks the documented field {field}"
        assert field in written, f"documented field {field} is not in what the code writes"
    assert set(written) <= set(table), f"fields the code writes but the table lacks: {set(written) - set(table)}"


def test_required_fields_are_those_the_parser_requires():
    for field, required in top_level_table().items():
        data = json.loads(example_text())
        del data[field]
        if required == "yes":
            with pytest.raises(BadManifest):
                manifest.parse(json.dumps(data))
        else:
            assert manifest.parse(json.dumps(data)).problems == [], field
