"""Text from files is shown verbatim, never acted on by the terminal nor parsed as rich markup."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console
from rich.errors import MarkupError

from reshard.text import markup_safe, shown

NAMES = [
    "\x1b[31mred\x1b[0m.weight",
    "[/bad]",
    "experts[gate].weight",
    "[qkv]",
    "[bold]loud[/bold]",
    "x\\[bold]y",
    "trailing\\",
    "two\\\\",
    "\x1b]0;pwned\x07",
    "evil\u202egnp.weight",
    "nbsp\u00a0and\u200bzero-width",
    "lone\ud800surrogate",
    "tab\tnew\nline",
    "c1\x9bcsi",
]


def render(markup: str) -> str:
    out = io.StringIO()
    Console(file=out, force_terminal=False, width=1000, emoji=False, highlight=False).print(markup)
    return out.getvalue().rstrip("\n")


@pytest.mark.parametrize("name", NAMES)
def test_markup_safe_renders_as_shown(name: str) -> None:
    assert render(f"[bold]tensor[/bold] {markup_safe(name)}: ok") == f"tensor {shown(name)}: ok"


def test_raw_names_are_the_problem() -> None:
    # The reason for markup_safe: interpolated raw, rich drops or chokes on these.
    assert render("[bold]loud[/bold]") == "loud"
    with pytest.raises(MarkupError):
        render("[/bad]")


def test_control_characters_become_visible_escapes() -> None:
    assert shown("\x1b[31mred") == "\\x1b[31mred"
    assert shown("\x1b]0;pwned\x07") == "\\x1b]0;pwned\\x07"
    assert shown("evil\u202egnp") == "evil\\u202egnp"
    assert shown("a\x7fb\x9bc") == "a\\x7fb\\x9bc"
    assert shown("lone\ud800") == "lone\\ud800"
    assert shown("tag\U000e0041") == "tag\\U000e0041"


def test_printable_text_is_unchanged() -> None:
    for text in ["model.layers.0.q_proj.weight", "re:a\\.b", "Gewichte.für.Köpfe", "层.权重", "a b"]:
        assert shown(text) == text


@given(st.text())
def test_shown_is_always_printable_and_encodable(text: str) -> None:
    out = shown(text)
    assert out.isprintable()
    out.encode("utf-8")  # no lone surrogates left
    if text.isprintable():
        assert out == text


@given(st.text())
def test_markup_safe_never_fails_and_round_trips(text: str) -> None:
    assert render(f"<[bold]{markup_safe(text)}[/bold]>") == f"<{shown(text)}>"


@pytest.mark.parametrize("name", ["end\\", "two\\\\", "\\", "x\\[bold]\\"])
def test_trailing_backslashes_show_as_written_before_a_tag_or_text(name: str) -> None:
    assert render(f"[bold]{markup_safe(name)}[/bold]") == name
    assert render(f"{markup_safe(name)}: ok") == f"{name}: ok"
    assert render(markup_safe(name)) == name


def test_a_verify_pattern_matching_nothing_is_warned_of_verbatim(tmp_path: Path) -> None:
    """``verify --include '[red]zz'`` warned 'matches nothing' with the pattern parsed as rich
    markup ("zz" shown, the tag eaten); it is the user's text, shown as given."""
    import numpy as np
    from safetensors.numpy import save_file

    f = tmp_path / "a.safetensors"
    save_file({"a": np.zeros(2, dtype=np.float32), "b": np.ones(2, dtype=np.float32)}, str(f))
    reshard = Path(sys.executable).with_name("reshard")
    r = subprocess.run(
        [str(reshard), "verify", str(f), str(f), "--include", "a", "--include", "[red]zz"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert '--include "[red]zz" matches nothing' in r.stderr
