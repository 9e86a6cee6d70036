"""MkDocs hook: the reference pages generated from the code, so they cannot drift from it.

Owns: the generated parts of the docs site. A page asks for one with a marker line:

* ``<!-- generated: cli -->``: every ``persistent-delta`` subcommand and option, read from the
  argparse parser (:func:`persistent_delta.cli.main.build_parser`);
* ``<!-- generated: settings -->``: every field of the settings dataclasses and every
  ``PERSISTENT_DELTA_*`` environment variable, read from ``persistent_delta/config.py``
  (plus the test-support variables of ``persistent_delta/testing.py``);
* ``<!-- generated: errors -->``: every exception class of ``persistent_delta/errors.py`` with
  its docstring and what to do about it (:data:`WHAT_TO_DO`; an error without an entry is a
  warning, so the strict build fails until it is documented).

The functions are importable (``docs/hooks.py`` is loaded by path) for tests.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import logging
import os
import re
import textwrap
from typing import Any, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_PY = os.path.join(REPO, "persistent_delta", "config.py")
TESTING_PY = os.path.join(REPO, "persistent_delta", "testing.py")
ERRORS_PY = os.path.join(REPO, "persistent_delta", "errors.py")
MARKER = re.compile(r"^<!-- generated: (\w+) -->$", re.M)
log = logging.getLogger("mkdocs.plugins.persistent_delta")

# The settings dataclasses, in the order a user meets them.
SETTINGS_CLASSES = ("PersistentTrackerConfig", "LogOptions", "WriterOptions", "RetentionBound")

# What to do about each error (its docstring says what happened).
WHAT_TO_DO: Dict[str, str] = {
    "PersistentDeltaError": "Catch it to handle every error this library raises on purpose.",
    "UsageError": "Catch it for every mistake in a call (its subclasses): fix the calling code; nothing was written.",
    "LogError": "Catch it for every failure of a log on disk (its subclasses); the subclass says what to do.",
    "ConsumerError": "Catch it for every refusal about a consumer or its position (its subclasses).",
    "StreamError": "Catch it for every failure across hosts (its subclasses); `exc.retriable` says whether to "
                   "try the call again.",
    "RejectedMessageError": "Nothing to undo: the reader skipped the message and applied nothing of it; "
                            "`RemoteConsumer.rejected` lists it. The subclass says what to check.",
    "InvalidInputError": "Fix the argument the message names; nothing was written.",
    "LogClosedError": "Do not use a handle after `close()`; open a new one.",
    "LogLockedError": "Another process (the message gives its pid, and host for a remote consumer) holds the "
                      "log or the consumer name. Stop it, or use another consumer name; a dead holder's claim "
                      "is released by the kernel (locally) or after 6 s (on a stream).",
    "NotALogError": "Check the path: it is not a log root, or not a persistent_delta log. Tools never create one.",
    "RankDirectoryError": "Pass the job's log root, the parent directory the message names, not a rank's "
                          "`rank-<r>` directory; add `ranks=[r]` to read that rank only.",
    "FormatMismatchError": "A log of format 1: stop the trainer and run `persistent-delta upgrade ROOT --execute`. "
                           "A stream message of another format: upgrade the shipper and consumers together.",
    "ConfigMismatchError": "The log was written with another update mode, tracking mode or table set: point the "
                           "tracker at a new path, or pass `fresh=True` to discard the old log.",
    "WorldSizeMismatchError": "Restore with the world size the checkpoint was saved with, each rank loading its "
                              "own state. To go on with another world size, start a fresh log (`fresh=True` or a "
                              "new path) and give replicas a new base (shard files).",
    "ForkedProcessError": "Open logs after forking (or use the `spawn` start method), not before.",
    "CorruptRecordError": "A record failed its checksum: run `persistent-delta verify ROOT`; restore the log "
                          "from a copy, or start the consumer past the damaged batch (`offsets --reset`).",
    "DamagedLogError": "The LMDB file itself is damaged (the message names it): it is never opened. Restore it "
                       "from a copy, or start that rank's log afresh.",
    "LogFullError": "Free disk space (or raise `max_map_size`), then call `tracker.resume()`: the kept steps "
                    "are committed and training goes on. Nothing committed was lost.",
    "LogIOError": "The device failed with space left: check the disk; the log reopens at its last commit.",
    "ReadOnlyLogError": "Open the log writable, or fix the directory's permissions. Readers keep working.",
    "LogAccessError": "Run as the log's owner, or have the trainer create it with group access "
                      "(`PERSISTENT_DELTA_GROUP_ACCESS=1`) and add the reader to its group.",
    "LogOwnershipError": "Another user may have planted that rank: check who wrote it, remove it, and keep the "
                         "log root writable by its owner only. Nothing of it was read.",
    "UnknownConsumerError": "Register the consumer first (`consumers=` of the tracker, a `DeltaConsumer`, or "
                            "`persistent-delta offsets ROOT --register NAME --execute`).",
    "OffsetOutOfRangeError": "The consumer's data was deleted (retention bound) or dropped by the stream. Start "
                             "again from a base, then poll with `reset=\"earliest\"`, or reset the position "
                             "(`offsets --reset NAME --to-earliest --execute`).",
    "ConsumerConflictError": "Someone moved the position between your read and your commit: poll again.",
    "ConsumerRoleError": "Use one consumer name to read (`get_unique`) and another to publish; to change a "
                         "consumer's use, `remove_consumer(name)` and add it again.",
    "IncompletePollError": "Poll again (with a timeout) until every rank completed the batches, or pass "
                           "`complete_only=False` if a partial poll is what you want.",
    "RanksBehindError": "Call `tracker.publish(consumer)` on every rank at the same steps (not on rank 0 only); "
                        "`poll.behind` and `persistent-delta offsets ROOT` name the ranks behind.",
    "RanksBehindWarning": "The same as `RanksBehindError`: publish on every rank at the same steps; the replica "
                          "stays stale on the other ranks' newer rows until then.",
    "WriterError": "Read the chained `__cause__`. After a full disk, free space and call `tracker.resume()`.",
    "WriterLogFullError": "Free disk space (or raise the map's limit), then call the tracker's `resume()`; "
                          "catch it as `WriterError` or `LogFullError`.",
    "InexactRangeError": "Start the range at the batch the message names, or replay by `--consumer`.",
    "OrderError": "Give `apply` its inputs in batch order, with no gap or overlap (the message names them).",
    "CheckpointError": "Catch it for every reason a base or increment cannot be restored; the subclass and "
                       "the message say which. Nothing was loaded into the model.",
    "IncompleteBaseError": "Nothing to fix in the model: restore from an older base (`Checkpoints.restore()` "
                           "passes over a base without DCP's `.metadata`), or take a new base.",
    "IncrementChainError": "Look at the directory the message names: move away what is not of this job's chain "
                           "(another base's, job's or run's part), or restore from the base alone by moving its "
                           "`increments` away.",
    "ShardLayoutError": "Restore with the world size and sharding plan the base was saved with; to change them, "
                        "start a fresh log (`fresh=True`) and take a new base.",
    "OlderLogError": "Nothing to undo: the reader skipped it and applied nothing of it. Someone publishes the "
                     "previous run's data again (or a stream kept across a fresh start still holds it): check who "
                     "may publish on the job's subjects (guides/security.md), and delete the old stream when a job "
                     "starts afresh.",
    "ServingLockError": "Apply from the consumer loop's thread, never from inside `replica.serving()` or a "
                        "request (the thread would wait for itself); nothing was written.",
    "StaleBaseError": "Start the replica from a fresh base: `save_local_shards` again on every rank of the trainer "
                      "(or wait for its next save), then `load_base`; across hosts `RemoteConsumer.bootstrap()`. "
                      "A replica that restarts loads the newest shard files, never the ones it first started from.",
    "ReplicaMismatchError": "Quantize the same model the trainer trains (same table names, rows and dims), and "
                            "register the replica's consumer with `format=\"float32\"` or the table's own "
                            "weight type (`\"int8\"`, `\"float16\"`).",
    "UnsupportedTrackingError": "Use a tracking mode the model supports (as TorchRec: EMBEDDING is EC-only).",
    "UnsupportedModeError": "Use one of the tracking modes TorchRec's tracker implements.",
    "TransportError": "The stream server could not be reached in time: check it runs and the URL, "
                      "credentials and TLS options; retry the call. Shippers retry by themselves.",
    "KeyConflictError": "Another process changed the key first: read it again and decide.",
    "JobNotFoundError": "Start the job's shipper (it creates the stream and buckets; consumers never do), "
                        "or pass `wait=` to wait for it; check the job name and the server.",
    "StreamLayoutError": "Ship with the job's recorded layout (leave `ranks_per_stream` / `--ranks-per-stream` "
                         "unset to follow it; `persistent-delta offsets --server ... --job ...` shows it), or "
                         "ship under a new job name.",
    "PermissionDeniedError": "Grant the user what its side needs (`persistent_delta.fleet.permissions`; "
                             "`docs/guides/security.md`), or connect as the right user.",
    "StreamKeyError": "Create a key with `persistent-delta keygen PATH` (owner-only), and give it to the "
                      "shipper and every consumer of the job (`key=`, `--key-file`, "
                      "`PERSISTENT_DELTA_STREAM_KEY_FILE`).",
    "KeyFileError": "Name the key file itself (a regular file; symbolic links are followed), owner-only "
                    "(`chmod 600`; 0440 when root owns it); in a Kubernetes secret volume set `defaultMode: 0400` "
                    "(`docs/guides/security.md`).",
    "CommandStoppedError": "Nothing to fix: SIGTERM/SIGINT stopped the command while it was blocked; it exits 0. "
                           "What a shipper had in flight is shipped again by the next one.",
    "AuthenticationError": "A message was forged, altered or signed with another key: check who can publish "
                           "on the job's subjects and that every side holds the job's key. The reader skipped "
                           "it (`subject` and `seq` name it).",
    "StreamDataError": "A message does not fit the job's tables (shape, dtype, ids, bounds): nothing of it was "
                       "applied. Check that the shipper and the consumers belong to the same job; `subject` and "
                       "`seq` name the message.",
}
# (An entry may name an error another change is adding; the check is that no error lacks one.)


# ------------------------------------------------------------------------------ the CLI


def _escape(text: str) -> str:
    """A docstring's text as one Markdown table cell: Sphinx roles become code spans."""
    text = re.sub(r":(?:class|func|meth|mod|attr|data|exc):`~?([^`]+)`",
                  lambda m: f"`{m.group(1).split('.')[-1] if m.group(0).count('~') else m.group(1)}`", text)
    text = text.replace("``", "`")
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _subparsers(parser: argparse.ArgumentParser) -> List[Tuple[str, str, argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:  # argparse keeps its subcommands here; no public accessor
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((name, helps.get(name, ""), sub))
    return out


def _option_row(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
    if action.option_strings and action.nargs != 0:
        names += f" `{action.metavar or action.dest.upper()}`"
    default = ""
    if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0:
        default = f"`{action.default}`"
    choices = f" (one of {', '.join(f'`{c}`' for c in action.choices)})" if action.choices else ""
    return f"| {names} | {_escape(action.help or '')}{choices} | {default} |"


def cli_markdown() -> str:
    """Markdown for every subcommand of ``persistent-delta``, from its argparse parser."""
    from persistent_delta.cli.main import build_parser

    parser = build_parser()
    parts = [f"`{parser.prog}`: {parser.description}", ""]
    for name, help_text, sub in _subparsers(parser):
        parts += [f"## {name}", "", f"{help_text[:1].upper()}{help_text[1:]}.", ""]
        if sub.description:
            parts += [sub.description, ""]
        usage = " ".join(sub.format_usage().replace("usage: ", "").split())
        parts += ["```text", textwrap.fill(usage, 96, subsequent_indent="    ", break_on_hyphens=False), "```", ""]
        parts += ["| argument | meaning | default |", "|---|---|---|"]
        parts += [_option_row(a) for a in sub._actions if not isinstance(a, argparse._HelpAction)]
        parts.append("")
    return "\n".join(parts)


# ------------------------------------------------------------------------------ settings


def _args_section(doc: str) -> Dict[str, str]:
    """The ``Args:`` entries of a Google docstring: name -> description (one line)."""
    lines = inspect.cleandoc(doc).splitlines()
    out: Dict[str, str] = {}
    try:
        start = lines.index("Args:") + 1
    except ValueError:
        return out
    current: Optional[str] = None
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break
        m = re.match(r"^    (\w+)(?: \([^)]*\))?: ?(.*)$", line)
        if m:
            current = m.group(1)
            out[current] = m.group(2).strip()
        elif current and line.strip():
            out[current] += " " + line.strip()
    return out


def _env_vars(path: str) -> Dict[str, Tuple[Optional[str], Optional[str]]]:
    """Every ``PERSISTENT_DELTA_*`` string literal in the code of ``path`` (docstrings aside):
    name -> (class, setting) it feeds, found as the keyword argument the literal sits in."""
    tree = ast.parse(open(path).read())
    found: Dict[str, Tuple[Optional[str], Optional[str]]] = {}

    def visit(node: ast.AST, cls: Optional[str], field: Optional[str]) -> None:
        if isinstance(node, ast.ClassDef):
            cls = node.name
        if isinstance(node, ast.FunctionDef) and node.name.startswith("_env_") and cls is None:
            cls, field = "LogOptions", node.name[len("_env_"):]  # a reader of one setting's variable
        if isinstance(node, ast.keyword) and node.arg:
            field = node.arg
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"PERSISTENT_DELTA_[A-Z_]+[A-Z]", node.value):
                found.setdefault(node.value, (cls, field))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant):
                continue  # a docstring
            visit(child, cls, field)

    visit(tree, None, None)
    return found


def _module_table(path: str) -> Dict[str, str]:
    """The environment table of a module docstring: variable -> meaning."""
    doc = ast.get_docstring(ast.parse(open(path).read())) or ""
    out: Dict[str, str] = {}
    current: Optional[str] = None
    for line in doc.splitlines():
        m = re.match(r"^``(PERSISTENT_DELTA_[A-Z_]+)``\s+(.*)$", line)
        if m:
            current = m.group(1)
            out[current] = m.group(2).strip()
        elif current and line.startswith(" ") and line.strip():
            out[current] += " " + line.strip()
        else:
            current = None
    return out


def settings_markdown() -> str:
    """Markdown for every setting of ``persistent_delta.config`` and every environment variable."""
    import dataclasses

    from persistent_delta import config

    env = _env_vars(CONFIG_PY)
    by_field = {(c, f): name for name, (c, f) in env.items()}
    parts: List[str] = []
    for cls_name in SETTINGS_CLASSES:
        cls = getattr(config, cls_name)
        docs = _args_section(cls.__doc__ or "")
        first = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        parts += [f"## {cls_name}", "", f"`persistent_delta.config.{cls_name}`: {first}", "",
                  "| setting | default | environment | meaning |", "|---|---|---|---|"]
        own = {f.name for f in dataclasses.fields(cls)}
        if cls_name == "PersistentTrackerConfig":  # TorchRec's own fields come first; keep ours
            own = {n for n in own if n in docs}
        for f in dataclasses.fields(cls):
            if f.name not in own:
                continue
            default = f.default if f.default is not dataclasses.MISSING else ""
            if isinstance(default, config.Durability):
                default = default.value
            var = by_field.get((cls_name, f.name)) or by_field.get(("LogOptions", f.name))
            var_text = f"`{var}`" if var else ""
            parts.append(f"| `{f.name}` | `{default!r}` | {var_text} | {_escape(docs.get(f.name, ''))} |")
            if f.name in own and f.name not in docs:
                log.warning("config.%s.%s has no Args entry in its docstring", cls_name, f.name)
        parts.append("")
    parts += ["## Environment variables", "",
              "Read when a log is opened. An explicit argument wins over the variable, the variable over "
              "the default.", "", "| variable | setting | meaning |", "|---|---|---|"]
    meanings = _module_table(CONFIG_PY)
    for name, (cls_name, field) in env.items():
        if name not in meanings and cls_name and field:
            meanings[name] = _args_section(getattr(config, cls_name).__doc__ or "").get(field, "")
    for name, (cls_name, field) in sorted(env.items()):
        setting = f"`{cls_name}.{field}`" if cls_name and field else ""
        parts.append(f"| `{name}` | {setting} | {_escape(meanings.get(name, ''))} |")
        if not setting and name not in meanings:
            log.warning("%s (config.py) feeds no setting and is not in config's environment table", name)
    for name in sorted(_env_vars(TESTING_PY)):
        parts.append(f"| `{name}` | | tests, demos and benchmarks only: the `nats-server` binary to start "
                     f"(`persistent_delta.testing`) |")
    parts.append("")
    return "\n".join(parts)


# ------------------------------------------------------------------------------ errors


def error_classes() -> List[type]:
    """Every exception class defined in ``persistent_delta.errors``, in source order."""
    from persistent_delta import errors

    names = [n.name for n in ast.parse(open(ERRORS_PY).read()).body if isinstance(n, ast.ClassDef)]
    return [getattr(errors, n) for n in names]


def errors_markdown() -> str:
    """Markdown for every error: its bases, what it means (docstring) and what to do."""
    parts: List[str] = []
    for cls in error_classes():
        bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
        doc = _escape(inspect.cleandoc(cls.__doc__ or "").replace("\n", " "))
        todo = WHAT_TO_DO.get(cls.__name__)
        if todo is None:
            log.warning("persistent_delta.errors.%s has no 'what to do' entry in docs/hooks.py", cls.__name__)
            todo = ""
        retry = "yes: the same call, later, can succeed" if getattr(cls, "retriable", False) else "no"
        parts += [f"## {cls.__name__}", "", f"*Subclass of {bases}.* {doc}", "", f"**What to do:** {todo}", "",
                  f"**Retriable:** {retry}.", ""]
    return "\n".join(parts)


# ------------------------------------------------------------------------------ the hook

GENERATORS = {"cli": cli_markdown, "settings": settings_markdown, "errors": errors_markdown}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    """Replace each ``<!-- generated: NAME -->`` marker with the generated Markdown."""

    def replace(m: "re.Match[str]") -> str:
        name = m.group(1)
        if name not in GENERATORS:
            log.warning("%s: unknown generated section %r", page.file.src_path, name)
            return m.group(0)
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)
