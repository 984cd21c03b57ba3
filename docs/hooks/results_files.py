"""MkDocs hook: the plots under `eval/results/` and the repository's own Markdown pages join the site as they are.

The runs write their plots to `eval/results/` (the README shows them from there); the pages reference them as
`eval/results/...`, so they are added to the build at that path instead of being copied into `docs/`.
CONTRIBUTING.md, CHANGELOG.md and the bundled model's card (with its figures) are pages of the site under their own
names.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
PAGES = {"contributing.md": "CONTRIBUTING.md", "changelog.md": "CHANGELOG.md",
         "model-card.md": "recguide_hf/bundled/recguide-tiny/README.md"}


def on_files(files, config):
    for png in sorted((ROOT / "eval" / "results").rglob("*.png")):
        files.append(File(str(png.relative_to(ROOT)), src_dir=str(ROOT), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    card = ROOT / "recguide_hf" / "bundled" / "recguide-tiny"  # the model card's own figures, beside it
    for png in sorted(card.rglob("*.png")):
        files.append(File(str(png.relative_to(card)), src_dir=str(card), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    for name, source in PAGES.items():
        files.append(File.generated(config, name, abs_src_path=str(ROOT / source)))
    return files
