"""The configuration reference is generated from the option declarations and kept current,
every option carries its description, and every relative link of the user's pages points
at a file (and heading) that exists."""

from __future__ import annotations

import pathlib
import re

import pytest

from shmtier import options_doc
from shmtier.config import KNOWN_KEYS

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Pages a user reads; their relative links must resolve.
PAGES = ("README.md", "docs/configuration.md", "docs/operating.md")


def test_docs_configuration_md_is_generated_from_the_declarations():
    written = (ROOT / "docs" / "configuration.md").read_text()
    assert written == options_doc.reference(), (
        f"docs/configuration.md is stale: regenerate it with `{options_doc.COMMAND}` "
        f"(from the repository root) and commit it")


def test_every_option_has_a_description_and_every_key_is_listed():
    rows = {}
    for heading, about, cls in options_doc.sections():
        assert about.strip(), heading
        for key, default, accepted, doc in cls.reference_rows():
            assert doc.strip() and accepted.strip() and default.strip(), (heading, key)
            rows.setdefault(heading, set()).add(key.strip("`"))
    top_level = set().union(*(rows[h] for h, _, _ in options_doc.SECTIONS
                              if h not in ("Compression", "ThrottledDropPolicy's policy_kwargs",
                                           "A secondary_tiers entry")))
    backpressure_keys = rows["Backpressure"]
    assert set(KNOWN_KEYS) <= top_level | backpressure_keys
    assert top_level - {"backpressure"} <= set(KNOWN_KEYS) | backpressure_keys
    tier_sections = {h for h, _, _ in options_doc.sections()} - {
        h for h, _, _ in options_doc.SECTIONS}
    assert {"fs tier", "obj tier", "p2p tier", "example tier"} <= tier_sections


def _slug(heading: str) -> str:
    """A Markdown heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _links(path: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    source = ROOT / page
    broken = []
    links = _links(source)
    for link in links:
        if re.match(r"^[a-z]+:", link):  # http(s), mailto: not ours to check
            continue
        target, _, anchor = link.partition("#")
        path = (source.parent / target).resolve() if target else source
        if not path.exists():
            broken.append(f"{link}: no file {path.relative_to(ROOT) if ROOT in path.parents else path}")
        elif anchor and (path.suffix != ".md" or anchor not in _anchors(path)):
            broken.append(f"{link}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{page} has links that do not resolve: {broken}"
    if page == "README.md":
        assert len(links) >= 5  # the README links its references; this test reads them


def test_the_slugs_are_githubs():
    assert _slug("Run it in a real vLLM server") == "run-it-in-a-real-vllm-server"
    assert _slug("Operating it: `shmtier ls`, `top`") == "operating-it-shmtier-ls-top"
    assert _slug("A secondary_tiers entry") == "a-secondary_tiers-entry"
