"""Self-contained HTML pages for the study reports. MLflow shows an HTML artifact in a sandboxed iframe, where a
relative ``<img src="loss_curves.png">`` resolves against nothing and the image is broken; so the images go into the
page itself, as base64 ``data:`` URIs. The Markdown beside the page keeps its relative links: it is read from disk,
next to its images.
"""

from __future__ import annotations

import base64
import html
import mimetypes
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from markdown_it import MarkdownIt

REPORT_CSS = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;line-height:1.45}"
              "table{border-collapse:collapse;font-size:0.9em}th,td{border:1px solid #ccc;padding:4px 8px;"
              "text-align:right}th:first-child,td:first-child{text-align:left}img{max-width:100%}"
              "code{background:#f3f3f3;padding:0 3px}")
_IMG_SRC = re.compile(r"""(<img\b[^>]*?\bsrc\s*=\s*)(["'])(.*?)\2""", re.IGNORECASE | re.DOTALL)


def inline_images(page: str, base_dir: Path) -> str:
    """``page`` with the ``src`` of every ``<img>`` that names a local file (a relative path, resolved against
    ``base_dir``, or a ``file:`` URI) replaced by a ``data:`` URI of the file's bytes; ``data:`` and remote sources
    are left as they are. A missing file raises FileNotFoundError: a report that shows a figure it did not write
    has a bug, and a broken image would hide it."""
    def replace(match: re.Match[str]) -> str:
        path = local_file(html.unescape(match[3]), base_dir)
        return match[0] if path is None else f"{match[1]}{match[2]}{data_uri(path)}{match[2]}"

    return _IMG_SRC.sub(replace, page)


def local_file(src: str, base_dir: Path) -> Path | None:
    """The file an ``src`` names, or None when it is not a local one (``data:``, ``http:``, ``//host/...``)."""
    parts = urlsplit(src)
    if parts.scheme not in ("", "file") or parts.netloc not in ("", "localhost") or not parts.path:
        return None
    path = Path(unquote(parts.path))
    path = path if path.is_absolute() else base_dir / path
    if not path.is_file():
        raise FileNotFoundError(f"the page shows {src!r}, but {path} is not a file")
    return path


def data_uri(path: Path) -> str:
    """``data:<type>;base64,...`` of the file, its type from its suffix (``image/png`` for a ``.png``)."""
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def markdown_page(markdown: str, title: str, base_dir: Path, css: str = REPORT_CSS) -> str:
    """A standalone HTML page of ``markdown`` (CommonMark with tables), its local images inlined
    (:func:`inline_images`, relative to ``base_dir``: where the Markdown file lies)."""
    body = MarkdownIt("commonmark").enable("table").render(markdown)
    return (f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{css}</style></head><body>\n{inline_images(body, base_dir)}</body></html>\n")
