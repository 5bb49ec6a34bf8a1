"""Tests of the repository tools: ``tools/*.py`` are scripts, so make them importable by name."""

import pathlib
import sys

TOOLS = pathlib.Path(__file__).resolve().parent.parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))
