"""The report page: the sections rendered through one jinja2 template (templates/report.html.j2),
HTML-escaped, with inline CSS and base64 plots, so the single file opens offline."""
from __future__ import annotations

import jinja2


def render_html(title: str, subtitle: str, sections: list[dict]) -> str:
    env = jinja2.Environment(loader=jinja2.PackageLoader("fusec.report", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    return env.get_template("report.html.j2").render(title=title, subtitle=subtitle, sections=sections)
