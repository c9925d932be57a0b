#!/usr/bin/env python3
"""The third-party requirements of Vigil and its SDK, one a line, read from their pyproject.toml files;
for the Dockerfile, which installs them in a layer of their own before it copies the code.

    vigil-requirements DIR [EXTRA...]    DIR/pyproject.toml and DIR/sdk/pyproject.toml's dependencies,
                                         with those of the root project's EXTRAs (`worker`)

The projects themselves (`vigil-training`, the SDK, is a dependency of `vigil`) are left out: they are
installed from the sources afterwards. Standard library only.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

OWN = {"vigil", "vigil-training"}


def requirements(root: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    sdk = tomllib.loads((root / "sdk" / "pyproject.toml").read_text())["project"]
    found = [*sdk.get("dependencies", []), *project.get("dependencies", [])]
    for extra in extras:
        found += project["optional-dependencies"][extra]
    name = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
    kept: list[str] = []
    for requirement in found:
        m = name.match(requirement)
        if m and m.group(1).lower().replace("_", "-") not in OWN and requirement not in kept:
            kept.append(requirement)
    return kept


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: vigil-requirements DIR [EXTRA...]", file=sys.stderr)
        return 2
    print("\n".join(requirements(Path(argv[0]), argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
