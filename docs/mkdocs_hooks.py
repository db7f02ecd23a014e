"""mkdocs hooks of the docs site (mkdocs.yml, ``hooks:``).

The docstrings cross-reference in Sphinx's roles (``:func:`name```), which mkdocstrings shows as text: the
role's prefix is dropped from the pages, leaving the name as code.
"""

import re

SPHINX_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):(?=<code>)")


def on_page_content(html, page, config, files):
    return SPHINX_ROLE.sub("", html)
