"""Renderers: Report -> str."""
import json

from graphmem.report import Report

from .markdown import render_markdown
from .text import render_text
from .tree import render_tree
from .units import fmt_bytes


def render_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2) + "\n"


__all__ = ["render_text", "render_json", "render_markdown", "render_tree", "fmt_bytes"]
