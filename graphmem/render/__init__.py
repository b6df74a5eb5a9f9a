"""Renderers: Report -> str."""
import json

from graphmem.render.markdown import render_markdown
from graphmem.render.text import render_text
from graphmem.render.tree import render_tree
from graphmem.report import Report
from graphmem.units import fmt_bytes


def render_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2) + "\n"


__all__ = ["render_text", "render_json", "render_markdown", "render_tree", "fmt_bytes"]
