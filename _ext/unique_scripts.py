"""Sphinx extension: add each script to a page once.

sphinx-thebe adds its inline configuration (`const THEBE_JS_URL = ...`) from an event
that Jupyter Book's build emits twice, so every page declared the same `const` twice
and the browser raised "Identifier 'THEBE_JS_URL' has already been declared"; and
Jupyter Book adds every script of `_static/` to each page, so a script that an
extension adds from there came twice. This drops the repeated entries from each
page's scripts, keeping the first of each.
"""

from __future__ import annotations


def _key(script) -> tuple:
    """What makes two script tags the same: file ('' or None: inline) and attributes."""
    filename = getattr(script, "filename", script) or ""
    attributes = getattr(script, "attributes", {}) or {}
    return (str(filename), tuple(sorted((k, str(v)) for k, v in attributes.items())))


def drop_repeated_scripts(app, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for script in scripts:
        key = _key(script)
        if key not in seen:
            seen.add(key)
            unique.append(script)
    scripts[:] = unique  # in place: handlers that run later append to this same list


def setup(app):
    # early: the event stops at the first handler that returns a template
    app.connect("html-page-context", drop_repeated_scripts, priority=100)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
