"""The docs' tools: code blocks are found with their fragment marks, and the generated
reference pages cover every subcommand, every error and every PERSISTENT_DELTA_* variable."""

from __future__ import annotations

import importlib.util
import os
import re

from doc_blocks import REPO, blocks, console_commands

_spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(REPO, "docs", "hooks.py"))
hooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hooks)


def test_blocks_are_found_with_their_fragment_mark(tmp_path, monkeypatch):
    import doc_blocks

    page = tmp_path / "p.md"
    page.write_text("text\n\n```python\nx = 1\n```\n\n<!-- fragment -->\n```python\nrun(job)\n```\n\n"
                    "- item:\n\n  ```console\n  $ persistent-delta verify deltas   # check\n  ok\n  ```\n")
    monkeypatch.setattr(doc_blocks, "REPO", str(tmp_path))
    found = blocks("p.md")
    assert [(b.lang, b.fragment, b.runs) for b in found] == [
        ("python", False, True), ("python", True, False), ("console", False, True)]
    assert console_commands(found[2].code) == ["persistent-delta verify deltas"]


def test_the_cli_reference_lists_every_subcommand_and_option():
    from persistent_delta.cli.main import build_parser

    text = hooks.cli_markdown()
    for name, _, sub in hooks._subparsers(build_parser()):
        assert f"## {name}" in text
        for action in sub._actions:
            for opt in action.option_strings:
                if opt in ("-h", "--help"):
                    continue
                assert f"`{opt}`" in text, (name, opt)


def test_the_errors_reference_has_every_error_and_what_to_do():
    from persistent_delta import errors

    classes = hooks.error_classes()
    defined = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)
               and v.__module__ == errors.__name__}
    assert {c.__name__ for c in classes} == defined
    missing = sorted(defined - set(hooks.WHAT_TO_DO))
    assert not missing, f"add a 'what to do' entry for {missing} to WHAT_TO_DO in docs/hooks.py"


def test_the_settings_reference_has_every_environment_variable():
    text = hooks.settings_markdown()
    used = set()
    for base, _, files in os.walk(os.path.join(REPO, "persistent_delta")):
        for f in files:
            if f.endswith(".py"):
                used |= set(re.findall(r'"(PERSISTENT_DELTA_[A-Z_]*[A-Z])"', open(os.path.join(base, f)).read()))
    assert used
    for name in used:
        assert f"`{name}`" in text, name
