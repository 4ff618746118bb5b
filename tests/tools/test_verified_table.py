"""``tools/verified_table.py`` on the CPU: the README's summary and ``docs/verified.md``'s table are what the tool
generates, the table's commit and date columns come from what each JSON recorded, and evidence that is missing or does
not fit a status is an error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools import verified_table as vt

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


@pytest.mark.parametrize("page", ["README.md", vt.TABLE_PAGE])
def test_each_page_block_is_what_the_tool_generates(page: str) -> None:
    difference = vt.diff(str(ROOT / page))
    assert not difference, f"{page}'s verified block is stale; run python tools/verified_table.py --write " \
                           f"{page}:\n{difference}"


def test_every_status_of_the_list_is_known_and_every_gpu_row_names_a_json() -> None:
    assert {c.status for c in vt.CAPABILITIES} == set(vt.STATUSES)
    assert all(c.jsons for c in vt.CAPABILITIES if c.status == vt.GPU)
    (te,) = [c for c in vt.CAPABILITIES if c.name.startswith("Transformer Engine")]
    assert te.status == vt.GPU and "docs/functional_te_h100_ep1.json" in te.jsons, te


def test_the_summary_lists_each_short_name_under_its_status_and_links_the_table(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("")
    _write(tmp_path / "docs" / "a.json", {"date": "2026-12-01", "commit": "1111111"})
    rows = [vt.Capability("a long name", vt.GPU, jsons=("docs/a.json",), short="a"),
            vt.Capability("b long", vt.CPU, tests=("tests/t.py",), short="b"),
            vt.Capability("c", vt.NEVER), vt.Capability("d long", vt.GPU, jsons=("docs/a.json",), short="d")]
    text = vt.summary(rows, root=str(tmp_path))
    assert text.splitlines()[:3] == ["- **ran on a GPU**: a; d.", "- **CPU only**: b.", "- **never run**: c."], text
    assert "[verified.md](docs/verified.md)" in text
    with pytest.raises(vt.VerifiedTableError, match="names the JSONs of its runs"):
        vt.summary([vt.Capability("no evidence", vt.GPU)], root=str(tmp_path))


def test_a_capability_naming_a_missing_json_is_an_error(tmp_path: Path) -> None:
    rows = [vt.Capability("a thing", vt.GPU, jsons=("docs/not_there.json",))]
    with pytest.raises(vt.VerifiedTableError, match=r"capability 'a thing' names docs/not_there\.json, which does "
                                                    r"not exist"):
        vt.table(rows, root=str(tmp_path))


@pytest.mark.parametrize("row, phrase", [
    (vt.Capability("gpu without a json", vt.GPU), "names the JSONs of its runs"),
    (vt.Capability("cpu without tests", vt.CPU), "names its tests"),
    (vt.Capability("never, with a test", vt.NEVER, tests=("tests/x.py",)), "names no JSONs and no tests"),
    (vt.Capability("cpu, missing test", vt.CPU, tests=("tests/unit/test_not_there.py",)), "which does not exist"),
    (vt.Capability("odd", "ran somewhere"), "is not one of"),
])
def test_evidence_that_does_not_fit_the_status_is_an_error(row: vt.Capability, phrase: str) -> None:
    with pytest.raises(vt.VerifiedTableError, match=phrase):
        vt.table([row])


def _write(path: Path, document: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))


def test_commit_and_date_are_read_from_each_json(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    # A report of runs, each with the provenance its run recorded (one of them dirty, one corrected by hand).
    _write(docs / "runs.json", {"runs": [
        {"provenance": {"git_commit": "1111111", "git_dirty": False, "commit_source": "git",
                        "date": "2026-12-01T10:00:00Z"}},
        {"provenance": {"git_commit": "2222222", "git_dirty": True, "date": "2026-12-02T10:00:00Z"}},
        {"provenance": {"git_commit": "1111111", "git_dirty": False, "date": "2026-12-01T11:00:00Z",
                        "note": "corrected by hand"}}]})
    # A record written by hand; a benchmark that recorded nothing; a report over runs, one without a commit.
    _write(docs / "by_hand.json", {"date": "2026-11-30", "commit": "3333333 (with a fix of 4444444)"})
    _write(docs / "bare.json", {"rows": [1, 2]})
    _write(docs / "report.json", {"provenance": {"git_commit": None, "git_commits": ["5555555", "unknown"],
                                                 "date": "2026-12-05T00:00:00Z", "first_date": "2026-12-04T00:00:00Z"}})
    rows = [vt.Capability(name, vt.GPU, jsons=(f"docs/{name}.json",)) for name in ("runs", "by_hand", "bare", "report")]
    lines = {line.split(" | ")[0].lstrip("| "): line.split(" | ")
             for line in vt.table(rows, root=str(tmp_path)).splitlines() if line.startswith("| ")}
    assert lines["runs"][2:] == ["[runs.json](docs/runs.json)", "1111111, 2222222-dirty\\*", "2026-12-01 to 2026-12-02 |"]
    assert lines["by_hand"][3:] == ["3333333\\*", "2026-11-30 |"]
    assert lines["bare"][3:] == ["no recorded commit", "no recorded date |"]
    assert lines["report"][3:] == ["5555555 (some records: no recorded commit)", "2026-12-04 to 2026-12-05 |"]


def test_check_prints_a_diff_and_write_repairs_the_block(tmp_path: Path) -> None:
    page = tmp_path / "README.md"
    page.write_text(f"# title\n\n{vt.START}\nan old table\n{vt.END}\n\nafter\n")
    tool = [sys.executable, str(ROOT / "tools" / "verified_table.py")]
    done = subprocess.run([*tool, "--check", str(page)], capture_output=True, text=True)
    assert done.returncode == 1 and "-an old table" in done.stdout and "+| capability |" in done.stdout, done
    assert subprocess.run([*tool, "--write", str(page)], capture_output=True, text=True).returncode == 0
    text = page.read_text()
    assert text.startswith(f"# title\n\n{vt.START}\n| capability |") and text.endswith(f"{vt.END}\n\nafter\n")
    assert "](../" in text  # links relative to the page's own folder
    assert subprocess.run([*tool, "--check", str(page)], capture_output=True, text=True).returncode == 0
    page.write_text(f"{vt.START}\n{vt.END}\n{vt.START}\n")
    done = subprocess.run([*tool, "--check", str(page)], capture_output=True, text=True)
    assert done.returncode == 2 and "needs exactly one" in done.stderr, done
    page.write_text("no markers\n")
    done = subprocess.run([*tool, "--check", str(page)], capture_output=True, text=True)
    assert done.returncode == 2 and "has no" in done.stderr, done
