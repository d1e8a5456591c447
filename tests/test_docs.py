"""The generated pages under docs/ match their sources, and the README stays a user's page."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tools import benchmarks_doc, configuration_doc, interfaces_doc

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_page_is_regenerated_from_the_argparse_definitions() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == configuration_doc.render(), (
        "docs/configuration.md is stale: run `make docs`")


def test_interfaces_page_is_regenerated_from_the_code() -> None:
    committed = (ROOT / "docs" / "interfaces.md").read_text()
    assert committed == interfaces_doc.render(), (
        "docs/interfaces.md is stale: run `python -m tools.interfaces_doc` (or `make docs`)")


def test_the_interfaces_page_changes_with_a_field_or_a_signature(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import service.model
    from kvcache.manager import KVCacheManager

    page = interfaces_doc.render()
    assert "    def free(self, seq_id: str) -> None: ..." in page
    assert "    eos_token_ids: tuple[int, ...]\n" in page

    grown = dataclasses.make_dataclass(
        "ModelConfig", [("draft_heads", int, dataclasses.field(default=0))],
        bases=(service.model.ModelConfig,), frozen=True, slots=True)
    monkeypatch.setattr(service.model, "ModelConfig", grown)

    def free(self, seq_id: str, *, scrub: bool = False) -> None:
        """Release the sequence's pages."""

    free.__qualname__ = "KVCacheManager.free"
    monkeypatch.setattr(KVCacheManager, "free", free)

    changed = interfaces_doc.render()
    assert changed != page
    assert "    draft_heads: int = 0\n" in changed
    assert "    def free(self, seq_id: str, *, scrub: bool = False) -> None: ...\n" in changed


def test_a_symbol_that_moved_fails_the_interfaces_page_by_its_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import service.model

    monkeypatch.delattr(service.model, "ModelConfig")
    with pytest.raises(interfaces_doc.InterfaceDocError, match=r"service\.model:ModelConfig"):
        interfaces_doc.render()
    gone = interfaces_doc.Section("gone", "A module that moved.", ("kvcache.nowhere:Thing",))
    with pytest.raises(interfaces_doc.InterfaceDocError, match=r"kvcache\.nowhere:Thing"):
        interfaces_doc.render((gone,))


def test_every_serve_flag_is_on_the_configuration_page() -> None:
    from service.serve.commands import build_parser

    serve = dict(configuration_doc.commands(build_parser()))["kvfence serve"]
    page = configuration_doc.render()
    flags = [o for a in configuration_doc.actions(serve) for o in a.option_strings
             if o.startswith("--")]
    assert "--kv-memory" in flags and "--scrub-policy" in flags
    missing = [f for f in flags if f not in ("--help",) and f"`{f}`" not in page]
    assert missing == []


def test_benchmark_results_are_one_per_suite_and_machine() -> None:
    results = benchmarks_doc.load()
    assert {r.suite for r in results} >= {"single_stream", "offline", "online"}
    assert benchmarks_doc.duplicates(results) == []


def test_a_second_result_of_a_suite_on_the_same_machine_is_refused(tmp_path: Path) -> None:
    source = benchmarks_doc.RESULTS / "offline.json"
    (tmp_path / "offline.json").write_text(source.read_text())
    (tmp_path / "offline_again.json").write_text(source.read_text())
    assert len(benchmarks_doc.duplicates(benchmarks_doc.load(tmp_path))) == 1


def test_readme_is_a_users_page_of_at_most_500_lines() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 500
    links = [part.split(")")[0] for part in "\n".join(lines).split("](")[1:]]
    local = [link.split("#")[0] for link in links if not link.startswith(("http", "#"))]
    missing = [link for link in local if not (ROOT / link).exists()]
    assert missing == [], f"README links to missing files: {missing}"


def test_every_suite_and_every_result_file_reaches_the_benchmarks_page() -> None:
    import json

    from bench.summary import SUITE_ORDER

    assert tuple(benchmarks_doc.SUITES) == SUITE_ORDER
    named = {json.loads(p.read_text()).get("suite") for p in benchmarks_doc.RESULTS.glob("*.json")}
    assert named - {None} <= set(benchmarks_doc.SUITES)


def _named_paths(text: str) -> set[str]:
    return set(re.findall(r"\b(?:service|kvcache|clients|tools|bench|tests|protos)/[\w/]+\.py\b",
                          text))


def test_every_source_file_the_docs_name_exists() -> None:
    """A page that names a module that moved or went fails here, so the maps
    (architecture.md, life-of-a-request.md, ...) say what the code is now."""
    pages = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    missing = [f"{page.name}: {path}" for page in pages
               for path in sorted(_named_paths(page.read_text()))
               if not (ROOT / path).exists()]
    assert missing == []


def test_named_path_check_reads_paths_in_prose() -> None:
    text = "see `service/admission/gate.py` and service/old_module.py, not service/http/"
    assert _named_paths(text) == {"service/admission/gate.py", "service/old_module.py"}
