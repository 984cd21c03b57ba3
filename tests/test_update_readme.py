"""eval/update_readme.py: each measured block lands between its markers on the one page that holds them, and the
committed pages are what the committed results files render to (a template or page edited without rerunning the
writer, or a marker lost in a moved page, fails here)."""

import pytest
from update_readme import PAGES, blocks, place

pytest.importorskip("jinja2")


def test_place_writes_between_markers_and_refuses_a_block_with_no_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("before <!-- a:start -->old<!-- a:end --> after")
    markers = ("<!-- a:start -->", "<!-- a:end -->")
    assert place([(markers, "new", "\n")], [page])[page] == "before <!-- a:start -->\nnew\n<!-- a:end --> after"
    with pytest.raises(SystemExit, match="no page holds the <!-- b:start --> marker"):
        place([(("<!-- b:start -->", "<!-- b:end -->"), "new", "\n")], [page])


def test_every_block_has_one_home_and_the_pages_are_up_to_date():
    written = blocks()
    texts = {page: page.read_text() for page in PAGES if page.exists()}
    for (start, _), _, _ in written:
        homes = [text for text in texts.values() if start in text]
        assert len(homes) == 1 and homes[0].count(start) == 1, start
    assert {s for (s, _), _, _ in written} >= {"<!-- speed:start -->", "<!-- headline:start -->",
                                                "<!-- results:start -->", "<!-- serving:start -->"}
    stale = [page.name for page, text in place(written).items() if text != texts[page]]
    assert stale == [], f"run `python eval/update_readme.py`: {stale} differ from what the results render to"
