"""Shipped model cards, their distillation logs and the documentation hold no absolute path of the machine that made
them (a card's commands name the base folder as BASE; generated pages show repository paths relative to it)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# roots of a machine's own paths (a workspace, a home); /tmp/... in a usage example is an example, not a record
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:work|root|home|Users)/[\w.-]+")


def shipped_texts():
    yield from (ROOT / "recguide_hf" / "bundled").glob("*/README.md")
    yield from (ROOT / "recguide_hf" / "bundled").glob("*/draft_lora/distill_log.json")
    yield from (ROOT / "model_cards").rglob("*.md")
    yield from (ROOT / "docs").glob("*.md")
    yield ROOT / "README.md"


def test_no_shipped_card_or_doc_holds_a_machine_path():
    found = {str(p.relative_to(ROOT)): MACHINE_PATH.findall(p.read_text()) for p in shipped_texts()}
    assert len(found) >= 5
    assert not {k: v for k, v in found.items() if v}, found


def test_the_pattern_finds_machine_paths_and_passes_examples():
    assert MACHINE_PATH.findall("recguide distill /work/cache/smollm2-base out") == ["/work/cache"]
    assert MACHINE_PATH.findall("--out /home/me/x.json") == ["/home/me"]
    assert not MACHINE_PATH.findall("--offload-folder /tmp/offload, ~/.cache/recguide/smollm2-base, eval/work/x")
