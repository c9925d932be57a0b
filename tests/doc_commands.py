"""The shell commands a documentation page prints, read the way a reader copies them: each fenced `bash`
block's lines, the trailing comment dropped, split at ` ; ` and ` && `. Tests run them as printed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
QUICKSTART = DOCS / "quickstart.md"
GUIDES = DOCS / "guides"

_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
_COMMENT = re.compile(r"\s+#.*$")


def bash_blocks(page: Path) -> list[list[str]]:
    """Each fenced bash block of `page`, as the list of commands it holds, in order."""
    blocks = []
    for body in _BLOCK.findall(page.read_text()):
        commands = []
        for line in body.splitlines():
            line = _COMMENT.sub("", line).strip()
            if line and not line.startswith("#"):
                commands += [c.strip() for c in re.split(r"\s+(?:;|&&)\s+", line) if c.strip()]
        blocks.append(commands)
    return blocks


def guide_pages() -> list[Path]:
    return sorted(GUIDES.glob("*.md"))
