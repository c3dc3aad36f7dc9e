"""MkDocs hook (mkdocs.yml ``hooks:``): the docstrings use Sphinx roles (``:class:`Name```), which
mkdocstrings renders as literal text before the code span; drop the role, keep the code span."""

import re

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):(?=<code>)")


def on_page_content(html, **kwargs):
    return _ROLE.sub("", html)
