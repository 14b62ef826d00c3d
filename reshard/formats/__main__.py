"""``python -m reshard.formats``: print the README's format list from the registry."""

from __future__ import annotations

import sys

from . import markdown

sys.stdout.write(markdown())
