"""Sphinx extension: readable labels for the five source documents in the references.

pybtex's alpha labels are built from the authors' names and the year. The source
documents of this book name no author (four of them) or one (001), and their entries
carry a descriptive author such as "The attention post", which alpha turned into
labels like [Theapost]. Their keys are readable already, so a source document is
labelled by its key ([Doc000] ... [Doc004]); every other entry keeps its alpha label.
Sorted by their descriptive authors, the five fell among the other entries and out of
their own order ([Doc001] among the B's): they come first, in the order of their keys.
"""

from __future__ import annotations

from pybtex.plugin import register_plugin
from pybtex.style.formatting.alpha import Style as AlphaStyle
from pybtex.style.labels.alpha import LabelStyle as AlphaLabelStyle
from pybtex.style.sorting.author_year_title import SortingStyle as AuthorYearTitle

SOURCE_PREFIX = "doc"  # references.bib: doc000 ... doc004


def is_source(key: str) -> bool:
    """Whether a bibliography key names one of the five source documents."""
    return key.startswith(SOURCE_PREFIX) and key[len(SOURCE_PREFIX) :].isdigit()


class SourceLabelStyle(AlphaLabelStyle):
    """Alpha labels, except [DocNNN] for the source documents."""

    def format_labels(self, sorted_entries):
        for entry, label in zip(sorted_entries, super().format_labels(sorted_entries)):
            key = entry.key
            if is_source(key):
                yield "Doc" + key[len(SOURCE_PREFIX) :]
            else:
                yield label


class SourceSortingStyle(AuthorYearTitle):
    """The source documents first, by key; then author, year and title."""

    def sorting_key(self, entry):
        if is_source(entry.key):
            return (0, entry.key, "", "")
        return (1, *super().sorting_key(entry))


class SourceLabelsStyle(AlphaStyle):
    """pybtex's alpha bibliography style with the sources' labels and order."""

    default_label_style = "aiayn-sources"
    default_sorting_style = "aiayn-sources"


def setup(app):
    register_plugin("pybtex.style.labels", "aiayn-sources", SourceLabelStyle)
    register_plugin("pybtex.style.sorting", "aiayn-sources", SourceSortingStyle)
    register_plugin("pybtex.style.formatting", "aiayn-sources", SourceLabelsStyle)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
